"""Reading a typed configuration (kvstore/config.py's dataclasses) from its layers: a
YAML or JSON file (duplicate keys and empty files refused), then environment variables
(each nested section with variables of its own, merged field by field), then
command-line overrides; every value coerced to its field's type, each failure a
ValueError that names the field. to_dict is the way back."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import typing
from pathlib import Path

import yaml

from kvstore.units import parse_size


def _coerce(tp, value, name: str):
    """`value` as type `tp`; every failure is a ValueError that starts with the field."""
    try:
        return _coerce_value(tp, value, name)
    except (TypeError, ValueError) as exc:
        msg = str(exc)
        if msg.startswith(name):
            raise
        raise ValueError(f"{name}: {msg}") from None


def _coerce_value(tp, value, name: str):
    origin = typing.get_origin(tp)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes", "on"):
            return True
        if str(value).lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}: expected a boolean, got {value!r}")
    if tp is int:
        if name.lower().endswith("bytes"):
            return parse_size(value)
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(f"{name}: expected a whole number, got {value!r}")
        return int(value)
    if tp is float:
        if isinstance(value, bool):
            raise ValueError(f"{name}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if isinstance(value, (list, dict)):
            kind = "a list" if isinstance(value, list) else "a mapping"
            raise ValueError(f"{name}: expected a string, got {kind} ({value!r})")
        return str(value)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, str):
            value = json.loads(value)
        if not isinstance(value, dict):
            raise ValueError(f"expected a mapping of {tp.__name__} fields, got {value!r}")
        return _build(tp, value, name)
    if origin is dict:
        _, vt = typing.get_args(tp)
        if isinstance(value, str):
            value = json.loads(value)
        if not isinstance(value, dict):
            raise ValueError(f"expected a mapping, got {value!r}")
        return {str(k): _coerce(vt, v, f"{name}.{k}") for k, v in value.items()}
    raise ValueError(f"{name}: unsupported type {tp}")


def _build(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown {prefix or cls.__name__} fields: {', '.join(unknown)}")
    kwargs = {
        k: _coerce(hints[k], v, f"{prefix}{'.' if prefix else ''}{k}") for k, v in data.items()
    }
    return cls(**kwargs)


def _unique_keys(pairs: list) -> dict:
    """A JSON object whose keys are all distinct (a repeated key silently took the last)."""
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} is given twice")
        out[k] = v
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that repeats a key (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:  # a list or mapping as a key: PyYAML's own error, not ours
                raise yaml.constructor.ConstructorError(
                    None, None, f"a key that is not a scalar: {key!r}", key_node.start_mark
                ) from None
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_config(
    cls, path: str | None = None, env_prefix: str | None = None, overrides: dict | None = None
):
    """File, then env, then overrides (None values ignored). Sections (fields with an
    `env_prefix`) merge field by field across the layers and read their own variables."""
    data: dict = {}
    if path:
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(f"{path}: cannot read: {exc.strerror}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"{path}: not UTF-8 text (byte {exc.start}: {raw[exc.start : exc.start + 1]!r})"
            ) from None
        # .json is JSON; anything else (.yaml, .YML, .conf ...) YAML, which reads JSON too
        is_yaml = not path.lower().endswith(".json")
        try:
            loaded = (
                yaml.load(text, Loader=_UniqueKeyLoader)
                if is_yaml
                else json.loads(text, object_pairs_hook=_unique_keys)
            )
        except (ValueError, yaml.YAMLError) as exc:
            raise ValueError(f"{path}: not valid {'YAML' if is_yaml else 'JSON'}: {exc}") from None
        if loaded is None:  # an empty ConfigMap mount would otherwise run on every default
            raise ValueError(
                f"{path}: holds no settings (empty, or only comments); give the settings, "
                "or leave out --config to run on the defaults"
            )
        if not isinstance(loaded, dict):
            raise ValueError(
                f"{path}: expected a mapping of {cls.__name__} fields, got {type(loaded).__name__}"
            )
        _layer(cls, data, loaded or {})
    from_env: dict[str, str] = {}  # field -> the variable that set it
    if env_prefix:
        hints = typing.get_type_hints(cls)
        known = {f"{env_prefix}{f.name.upper()}" for f in dataclasses.fields(cls)}
        unknown = sorted(
            k
            for k, v in os.environ.items()
            if k.startswith(env_prefix) and k not in known and not _service_link(k, v)
        )
        if unknown:  # as in the sections: a misspelt variable is not ignored without a word
            raise ValueError(
                f"unknown {cls.__name__} settings in the environment: {', '.join(unknown)} "
                f"(known: {', '.join(sorted(known))})"
            )
        env = {}
        for f in dataclasses.fields(cls):
            var = f"{env_prefix}{f.name.upper()}"
            if var in os.environ:
                _coerce(hints[f.name], os.environ[var], var)  # a bad value names its variable
                env[f.name], from_env[f.name] = os.environ[var], var
        _layer(cls, data, env)
        _layer(cls, data, _section_env(cls))
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    _layer(cls, data, given)
    try:
        return _build(cls, data)
    except ValueError as exc:  # a range check in __post_init__: say where the value came from
        said = set(re.findall(r"[a-z_][a-z0-9_]*", str(exc)))
        named = [var for f, var in from_env.items() if f not in given and f in said]
        if not named:
            raise
        raise ValueError(f"{exc} (set by {', '.join(named)})") from None


# What Kubernetes puts in a pod's environment for each Service (service links): a Service
# named kvstore-agent gives KVSTORE_AGENT_SERVICE_HOST=10.96.0.12, KVSTORE_AGENT_PORT=
# tcp://10.96.0.12:50051, KVSTORE_AGENT_PORT_50051_TCP_PROTO=tcp, ... (suffix: value shape)
_IP = r"[0-9a-fA-F.:]+"
_URL = rf"(tcp|udp|sctp)://(\[{_IP}\]|{_IP}):[0-9]+"
_SERVICE_LINKS = [
    (re.compile(r"_SERVICE_HOST$"), re.compile(_IP)),
    (re.compile(r"_SERVICE_PORT(_[A-Z0-9_]+)?$"), re.compile(r"[0-9]+")),
    (re.compile(r"_PORT(_[0-9]+_(TCP|UDP|SCTP))?$"), re.compile(_URL)),
    (re.compile(r"_PORT_[0-9]+_(TCP|UDP|SCTP)_PROTO$"), re.compile(r"tcp|udp|sctp")),
    (re.compile(r"_PORT_[0-9]+_(TCP|UDP|SCTP)_PORT$"), re.compile(r"[0-9]+")),
    (re.compile(r"_PORT_[0-9]+_(TCP|UDP|SCTP)_ADDR$"), re.compile(_IP)),
]


def _service_link(name: str, value: str) -> bool:
    """Whether `name`=`value` is one of Kubernetes' service-link variables (a name and a
    value of their shapes), not a misspelt setting."""
    return any(n.search(name) and v.fullmatch(value) for n, v in _SERVICE_LINKS)


def _sections(cls) -> dict[str, str]:
    """Section fields of `cls` and the prefix of their own environment variables."""
    return {
        f.name: f.metadata["env_prefix"]
        for f in dataclasses.fields(cls)
        if "env_prefix" in f.metadata
    }


def _section_env(cls) -> dict:
    """Each section's <PREFIX><FIELD> variables. An unknown name under a section's prefix
    is an error: the prefix is the section's alone, and a misspelt variable would
    otherwise be ignored without a word."""
    hints = typing.get_type_hints(cls)
    out: dict = {}
    for name, prefix in _sections(cls).items():
        known = {f"{prefix}{f.name.upper()}": f.name for f in dataclasses.fields(hints[name])}
        unknown = sorted(k for k in os.environ if k.startswith(prefix) and k not in known)
        if unknown:
            raise ValueError(
                f"unknown {name} settings in the environment: "
                f"{', '.join(unknown)} (known: {', '.join(sorted(known))})"
            )
        hints_ = typing.get_type_hints(hints[name])
        given = {}
        for var, field_ in known.items():
            if var in os.environ:
                _coerce(hints_[field_], os.environ[var], var)  # a bad value names its variable
                given[field_] = os.environ[var]
        if given:
            out[name] = given
    return out


def _layer(cls, data: dict, layer: dict) -> None:
    """Apply one configuration layer: a value replaces the one below, except in sections,
    where two mappings merge field by field."""
    sections = _sections(cls)
    for key, value in layer.items():
        below, above = _mapping(data.get(key)), _mapping(value)
        if key in sections and below is not None and above is not None:
            data[key] = {**below, **above}
        else:
            data[key] = value


def _mapping(value) -> dict | None:
    """`value` as a mapping of fields (a dict, a dataclass, or JSON text of one); None
    when it is none of those (_build then reports it)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value if isinstance(value, dict) else None


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
