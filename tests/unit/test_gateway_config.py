"""GatewayConfig and the API-key file: what is refused before serving, and the grants a
key carries (tenant, optionally the models it may use)."""

from __future__ import annotations

import pytest

from kvstore.config import TLSConfig, load_config
from router.gateway.config import ApiKeys, GatewayConfig, ReloadingApiKeys
from router.gateway.tls import GatewayTLS


def test_keys_map_to_tenants_and_optionally_to_models():
    keys = ApiKeys({"k1": "acme", "k2": {"tenant": "globex", "models": ["tiny"]}})
    assert keys.tenant("k1") == "acme" and keys.grant("k1").allows("anything")
    g = keys.grant("k2")
    assert g is not None and g.tenant == "globex"
    assert g.allows("tiny") and not g.allows("other")
    assert keys.grant("k3") is None


@pytest.mark.parametrize(
    "value",
    [
        "",
        None,
        3,
        {"models": ["tiny"]},
        {"tenant": "a", "models": "tiny"},
        {"tenant": "a", "models": [""]},
        {"tenant": "a", "role": "admin"},
    ],  # fmt: skip
)
def test_bad_key_entries_are_refused_without_naming_the_key(value):
    with pytest.raises(ValueError) as ei:
        ApiKeys({"sk-secret-key": value})
    assert "sk-secret-key" not in str(ei.value)


def test_https_follows_the_routers_files_unless_told_otherwise():
    router = TLSConfig("/tls/ca.crt", "/tls/tls.crt", "/tls/tls.key", server_name="kv.svc")
    tls = GatewayTLS.resolve(GatewayConfig(), router)
    assert tls == GatewayTLS("/tls/tls.crt", "/tls/tls.key", "/tls/ca.crt", False, "kv.svc")
    assert GatewayTLS.resolve(GatewayConfig(https=False), router) is None
    assert GatewayTLS.resolve(GatewayConfig(), TLSConfig()) is None
    own = GatewayConfig(tls_cert_file="/own.crt", tls_key_file="/own.key")
    assert GatewayTLS.resolve(own, router) == GatewayTLS("/own.crt", "/own.key", "")
    with pytest.raises(ValueError, match="require_client_cert needs a CA"):
        GatewayTLS.resolve(
            GatewayConfig(tls_cert_file="/c", tls_key_file="/k", require_client_cert=True),
            TLSConfig(),
        )
    with pytest.raises(ValueError, match="tls_ca_file needs"):
        GatewayConfig(tls_ca_file="/ca.crt")
    with pytest.raises(ValueError, match="max_inflight_per_tenant"):
        GatewayConfig(max_inflight_per_tenant=-1)


@pytest.mark.parametrize("value", [0, -1])
def test_a_prompt_token_cap_below_one_is_refused(value):
    with pytest.raises(ValueError, match=rf"max_prompt_tokens must be >= 1 .*got {value}"):
        GatewayConfig(max_prompt_tokens=value)


@pytest.mark.parametrize(
    "var,value,match",
    [
        ("KVSTORE_GATEWAY_MAX_PROMPT_TOKENS", "lots", r"^KVSTORE_GATEWAY_MAX_PROMPT_TOKENS: "),
        ("KVSTORE_GATEWAY_HTTPS", "maybe", r"^KVSTORE_GATEWAY_HTTPS: expected a boolean"),
        ("KVSTORE_GATEWAY_MAX_BODY_BYTES", "big", r"^KVSTORE_GATEWAY_MAX_BODY_BYTES: "),
        (
            "KVSTORE_GATEWAY_MAX_PROMPT_TOKENS",
            "0",
            r"max_prompt_tokens must be >= 1 .*\(set by KVSTORE_GATEWAY_MAX_PROMPT_TOKENS\)$",
        ),
    ],
)
def test_a_bad_environment_value_names_its_variable(monkeypatch, tmp_path, var, value, match):
    """The operator set a variable, not a field: the error says which variable."""
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=match):
        load_config(GatewayConfig, None, "KVSTORE_GATEWAY_", {"tokenizers": {"m": str(tmp_path)}})


def test_a_value_from_the_environment_is_read_as_its_type(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSTORE_GATEWAY_MAX_BODY_BYTES", "2MiB")
    monkeypatch.setenv("KVSTORE_GATEWAY_HTTPS", "off")
    cfg = load_config(GatewayConfig, None, "KVSTORE_GATEWAY_", {"tokenizers": {"m": str(tmp_path)}})
    assert (cfg.max_body_bytes, cfg.https) == (2 << 20, False)


def test_max_choices_below_one_is_refused(tmp_path):
    with pytest.raises(ValueError, match="max_choices must be >= 1"):
        GatewayConfig(listen="127.0.0.1:1", tokenizers={"m": str(tmp_path)}, max_choices=0)


@pytest.mark.parametrize("listen", ["127.0.0.1:99999", "nohost", "127.0.0.1:", ":8080", "h:8x"])
def test_a_bad_gateway_listen_is_refused_by_the_config(tmp_path, listen):
    """Before the fix 127.0.0.1:99999 was an OverflowError traceback at bind time, after
    joining etcd, and nohost "invalid literal for int()"."""
    with pytest.raises(ValueError, match=r"^gateway listen must be host:port with a port in 0"):
        GatewayConfig(listen=listen, tokenizers={"m": str(tmp_path)}, api_keys_file="/k")
    GatewayConfig(listen="[::1]:0", tokenizers={"m": str(tmp_path)}, api_keys_file="/k")


@pytest.mark.parametrize(
    "field,value",
    [
        ("header_timeout_s", 0),
        ("header_timeout_s", float("nan")),
        ("body_timeout_s", -1),
        ("body_timeout_s", float("inf")),
        ("send_timeout_s", 0),
        ("send_timeout_s", float("nan")),
        ("request_timeout_s", float("nan")),
        ("max_header_bytes", 0),
        ("max_connections", 0),
    ],
)
def test_connection_limits_must_be_positive_and_finite(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be (a positive finite number|>= 1)"):
        GatewayConfig(**{field: value})


def test_connection_limits_load_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSTORE_GATEWAY_MAX_HEADER_BYTES", "32KiB")
    monkeypatch.setenv("KVSTORE_GATEWAY_HEADER_TIMEOUT_S", "2.5")
    cfg = load_config(GatewayConfig, None, "KVSTORE_GATEWAY_", {"tokenizers": {"m": str(tmp_path)}})
    assert (cfg.max_header_bytes, cfg.header_timeout_s) == (32 << 10, 2.5)
    assert (cfg.body_timeout_s, cfg.max_connections) == (60.0, 1024)


def test_an_empty_key_mapping_revokes_every_key_on_reload_not_at_start_up(tmp_path):
    """Before the fix `{}` "did not load" and every old key kept working. At start-up it
    is still refused: a gateway nobody can use is a mistake."""
    path = tmp_path / "keys.json"
    path.write_text("{}")
    with pytest.raises(ValueError, match="expected a mapping of key -> tenant"):
        ReloadingApiKeys(str(path), interval_s=0)
    path.write_text('{"key-acme": "acme"}')
    keys = ReloadingApiKeys(str(path), interval_s=0)
    assert keys.tenant("key-acme") == "acme"
    path.write_text("{}")
    assert keys.grant("key-acme") is None and len(keys) == 0
    path.write_text('{"key-acme": "acme", "key-new": "globex"}')
    assert keys.tenant("key-new") == "globex"


def test_an_emptied_or_deleted_key_file_keeps_the_keys_with_a_warning(tmp_path, caplog):
    """What a rewrite in place shows for a moment (an empty file) and a file gone (a
    replace by delete and create, a volume unmounted) revoke nothing: the keys in force
    stay, and the log says so and how to revoke every key."""
    path = tmp_path / "keys.yaml"
    path.write_text("key-acme: acme\n")
    keys = ReloadingApiKeys(str(path), interval_s=0)
    caplog.set_level("WARNING", logger="kvstore.gateway")
    for change in (lambda: path.write_text(""), lambda: path.write_text("# soon\n"), path.unlink):
        change()
        assert keys.tenant("key-acme") == "acme"
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3, said
    assert "is empty" in said[0] and "keeping the keys in force" in said[0]
    assert "is missing; keeping the 1 keys in force" in said[2] and "write {}" in said[2]
    path.write_text("{}\n")
    assert keys.grant("key-acme") is None


def test_max_connections_per_client_is_off_by_default_and_never_negative(monkeypatch, tmp_path):
    assert GatewayConfig().max_connections_per_client == 0
    with pytest.raises(
        ValueError, match=r"^max_connections_per_client must be >= 0 \(0: no cap\), got -1$"
    ):
        GatewayConfig(max_connections_per_client=-1)
    monkeypatch.setenv("KVSTORE_GATEWAY_MAX_CONNECTIONS_PER_CLIENT", "64")
    cfg = load_config(GatewayConfig, None, "KVSTORE_GATEWAY_", {"tokenizers": {"m": str(tmp_path)}})
    assert cfg.max_connections_per_client == 64
