"""Namespaces: the exact model configuration a KV block is valid for.

A namespace is the tuple of everything that changes hidden states or token ids. Its
canonical encoding is versioned, length-prefixed and little-endian, so the same tuple
gives the same bytes on every host and in every language:

    b"kvns1" then, for each field in FIELDS order:
      str   -> u32 length + UTF-8 bytes
      float -> IEEE-754 binary64 (NaN refused, -0.0 written as 0.0)
      int   -> u64
      bool  -> u8 (0 or 1)

`namespace_id` is BLAKE2b-128 of that encoding. The chain root of the blocks adds the
generation and is keyed with the tenant's secret (public namespaces are unkeyed), so a
tenant's block ids cannot be computed or probed without its secret.
"""

from __future__ import annotations

import hashlib
import math
import struct
import unicodedata
from dataclasses import dataclass, fields
from typing import NewType

from kvstore.errors import InvalidArgument

NamespaceId = NewType("NamespaceId", bytes)


def tenant_name_problem(tenant: str) -> str:
    """Why `tenant` cannot name a tenant ("" when it can): the one rule for namespaces,
    tenants.json and `kvctl quota` (a name with a space is a typo there, not a tenant)."""
    if not tenant:
        return "is empty"
    if "/" in tenant:
        return "contains '/'"
    if not tenant.isprintable() or any(c.isspace() for c in tenant):
        return "contains whitespace or control characters"
    return ""


# Bidirectional embeddings, overrides and isolates: they reorder what a terminal shows.
_BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _moves_a_terminal(text: str) -> bool:
    """Whether `text` holds a character that acts on a terminal or splits a log line:
    a control character (Cc: newline, tab, CR, ESC ...), a line or paragraph separator,
    a bidirectional control. Spaces of any script and joiners (ZWJ in emoji, ZWNJ in
    Persian) are text."""
    return any(unicodedata.category(c) in ("Cc", "Zl", "Zp") or c in _BIDI_CONTROLS for c in text)


_MAGIC = b"kvns1"
_ROOT_PERSON = b"kvstore-root-v1"
_TENANT_PERSON = b"kvstore-tenant"
MAX_BLOCK_SIZE = 4096
# Upper bound on the canonical encoding of a spec. Every namespace lives in one etcd record
# (its JSON is at most ~3x this with \u-escapes), and a flush rewrites every record of a
# name in one transaction of up to 128 operations: 2 KiB keeps that far below etcd's
# request limit (1.5 MiB by default). Real specs are a few hundred bytes.
MAX_SPEC_BYTES = 2048

# bytes per element of each accepted KV dtype (fp4/int4 packed two per byte are refused
# for now: a block payload must be a whole number of bytes per element).
KV_DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
}

_STR_FIELDS = (
    "tenant",
    "name",
    "model_name",
    "model_revision",
    "adapter_id",
    "adapter_revision",
    "tokenizer_id",
    "tokenizer_revision",
    "rope_type",
    "rope_scaling",
    "attention_impl",
    "kv_dtype",
    "prompt_template_version",
)
_POSITIVE_INT_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "tp_size", "block_size")


@dataclass(frozen=True, slots=True)
class Namespace:
    """Every field is required: say "none" explicitly for an unused adapter or scaling."""

    tenant: str
    name: str
    model_name: str
    model_revision: str
    adapter_id: str
    adapter_revision: str
    tokenizer_id: str
    tokenizer_revision: str
    rope_type: str
    rope_theta: float
    rope_scaling: str
    attention_impl: str
    kv_dtype: str
    prompt_template_version: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_rank: int
    tp_size: int
    block_size: int = 16
    public: bool = False

    def __post_init__(self) -> None:
        missing = [
            f
            for f in _STR_FIELDS
            if not isinstance(getattr(self, f), str) or not getattr(self, f).strip()
        ]
        missing += [
            f
            for f in _POSITIVE_INT_FIELDS
            if not _is_int(getattr(self, f)) or getattr(self, f) <= 0
        ]
        # An unset proto double reads 0.0: name it with the other missing fields.
        if self.rope_theta == 0:
            missing.append("rope_theta")
        if missing:
            raise InvalidArgument(
                "namespace is missing required fields (empty or zero): " + ", ".join(missing)
            )
        # Names reach operators' terminals (kvctl namespaces, logs): no escape sequences.
        if unsafe := [f for f in _STR_FIELDS if _moves_a_terminal(getattr(self, f))]:
            raise InvalidArgument(
                f"namespace {', '.join(unsafe)} must not contain control characters "
                "(newline, tab, escape sequences, line separators, bidirectional overrides)"
            )
        if "/" in self.tenant or "/" in self.name:
            raise InvalidArgument("namespace tenant and name must not contain '/'")
        if problem := tenant_name_problem(self.tenant):
            raise InvalidArgument(f"namespace tenant {self.tenant!r} {problem}")
        if not _is_int(self.tp_rank) or not 0 <= self.tp_rank < self.tp_size:
            raise InvalidArgument(
                f"namespace tp_rank must be in [0, tp_size={self.tp_size}), got {self.tp_rank!r}"
            )
        if (
            not isinstance(self.rope_theta, (int, float))
            or not math.isfinite(self.rope_theta)
            or self.rope_theta <= 0
        ):
            raise InvalidArgument(
                f"namespace rope_theta must be a positive finite number, got {self.rope_theta!r}"
            )
        if self.kv_dtype not in KV_DTYPE_BYTES:
            raise InvalidArgument(
                f"namespace kv_dtype {self.kv_dtype!r} is not one of {sorted(KV_DTYPE_BYTES)}"
            )
        if self.block_size > MAX_BLOCK_SIZE:
            raise InvalidArgument(
                f"namespace block_size {self.block_size} exceeds {MAX_BLOCK_SIZE}"
            )
        if not isinstance(self.public, bool):
            raise InvalidArgument("namespace public must be a bool")
        size = len(self.canonical_bytes())
        if size > MAX_SPEC_BYTES:
            raise InvalidArgument(
                f"namespace spec is {size} bytes encoded; the limit is {MAX_SPEC_BYTES} "
                "bytes (it must fit in one etcd record): shorten its string fields"
            )

    @property
    def key(self) -> str:
        """Operator-facing name, `tenant/name`."""
        return f"{self.tenant}/{self.name}"

    @property
    def dtype_bytes(self) -> int:
        return KV_DTYPE_BYTES[self.kv_dtype]

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x KV heads x head dim x bytes per element."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_size

    def canonical_bytes(self) -> bytes:
        out = [_MAGIC]
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool):
                out.append(b"\x01" if v else b"\x00")
            elif isinstance(v, str):
                raw = v.encode("utf-8")
                out.append(struct.pack("<I", len(raw)) + raw)
            elif isinstance(v, float) or f.name == "rope_theta":
                out.append(struct.pack("<d", float(v) + 0.0))
            else:
                out.append(struct.pack("<Q", v))
        return b"".join(out)

    @property
    def namespace_id(self) -> NamespaceId:
        return NamespaceId(hashlib.blake2b(self.canonical_bytes(), digest_size=16).digest())

    def root(self, generation: int, tenant_secret: bytes | str | None) -> bytes:
        """Chain root for `generation`: keyed by the tenant secret unless public."""
        if generation < 0:
            raise InvalidArgument("generation must be >= 0")
        key = b"" if self.public else tenant_key(self.tenant, tenant_secret)
        h = hashlib.blake2b(digest_size=16, key=key, person=_ROOT_PERSON)
        h.update(self.canonical_bytes())
        h.update(struct.pack("<Q", generation))
        return h.digest()

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "Namespace":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise InvalidArgument("unknown namespace fields: " + ", ".join(unknown))
        required = [f.name for f in fields(cls) if f.name not in ("block_size", "public")]
        missing = [n for n in required if n not in d]
        if missing:
            raise InvalidArgument("namespace is missing required fields: " + ", ".join(missing))
        return cls(**d)


def tenant_key(tenant: str, secret: bytes | str | None) -> bytes:
    """32-byte BLAKE2b key for a tenant's chain roots, derived from its secret."""
    if not secret:
        raise InvalidArgument(
            f"tenant {tenant!r} needs a secret to derive chain roots "
            "(only public namespaces are unkeyed)"
        )
    raw = secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)
    return hashlib.blake2b(
        raw,
        digest_size=32,
        person=_TENANT_PERSON,
        salt=hashlib.blake2b(tenant.encode(), digest_size=16).digest(),
    ).digest()


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
