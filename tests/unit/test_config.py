"""Typed configuration: file, then env, then overrides; every bad value names its field."""

from __future__ import annotations

import hashlib
import json
import os
import re

import pytest

from kvstore.config import AgentConfig, PeerConfig, RouterConfig, TenantConfig, load_config, to_dict
from kvstore.policy import NamespacePolicy
from kvstore.grpc_edge import keepalive_options

MiB = 1 << 20
YAML = """\
node_id: gpu-3
listen: 127.0.0.1:0
device: cpu
pool_bytes: 16MiB
slot_bytes: 64KiB
nvme_bytes: 2GiB
eviction: lru
allow_unauthenticated: true
default_policy:
  ttl_seconds: 600
  persist: false
policies:
  acme/chat:
    min_prefix_blocks: 2
    pin_budget_bytes: 1MiB
tenants:
  acme:
    token_sha256: {digest}
    hbm_limit_bytes: 8MiB
"""


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("KVSTORE_AGENT_", "KVSTORE_PEER_", "KVSTORE_ENCRYPTION_")):
            monkeypatch.delenv(k)


def write(tmp_path, text, name="agent.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_load_from_yaml(tmp_path):
    digest = hashlib.sha256(b"acme-token").hexdigest()
    cfg = load_config(AgentConfig, write(tmp_path, YAML.format(digest=digest)))
    assert cfg.node_id == "gpu-3" and cfg.device == "cpu" and cfg.eviction == "lru"
    assert cfg.pool_bytes == 16 * MiB and cfg.slot_bytes == 64 << 10
    assert cfg.nvme_bytes == 2 << 30 and cfg.pool_slots == 256
    assert cfg.allow_unauthenticated is True
    assert cfg.default_policy == NamespacePolicy(ttl_seconds=600.0, persist=False)
    assert cfg.policy_for("acme", "chat") == NamespacePolicy(
        min_prefix_blocks=2, pin_budget_bytes=MiB
    )
    assert cfg.policy_for("acme", "other") == cfg.default_policy
    assert cfg.tenants == {"acme": TenantConfig(token_sha256=digest, hbm_limit_bytes=8 * MiB)}


def test_load_from_json_and_round_trip(tmp_path):
    import json

    cfg = load_config(
        AgentConfig,
        write(
            tmp_path,
            json.dumps({"pool_bytes": 4 * MiB, "tenants": {"b": {"nvme_limit_bytes": "1GiB"}}}),
            "a.json",
        ),
    )
    assert cfg.pool_bytes == 4 * MiB and cfg.tenants["b"].nvme_limit_bytes == 1 << 30
    assert load_config(AgentConfig, overrides=to_dict(cfg)) == cfg


def test_env(monkeypatch):
    monkeypatch.setenv("KVSTORE_AGENT_POOL_BYTES", "32MiB")
    monkeypatch.setenv("KVSTORE_AGENT_ALLOW_UNAUTHENTICATED", "yes")
    monkeypatch.setenv("KVSTORE_AGENT_EXPIRE_INTERVAL_S", "2.5")
    monkeypatch.setenv("KVSTORE_AGENT_TENANTS", '{"acme": {"hbm_limit_bytes": "1MiB"}}')
    cfg = load_config(AgentConfig, env_prefix="KVSTORE_AGENT_")
    assert cfg.pool_bytes == 32 * MiB
    assert cfg.allow_unauthenticated is True
    assert cfg.expire_interval_s == 2.5
    assert cfg.tenants["acme"].hbm_limit_bytes == MiB


def test_a_misspelt_variable_is_an_error_naming_it(monkeypatch):
    """It was ignored without a word (a config file's unknown key is refused)."""
    monkeypatch.setenv("KVSTORE_AGENT_POOL_BYTS", "1")
    with pytest.raises(ValueError, match="unknown AgentConfig settings in the environment: "
                       "KVSTORE_AGENT_POOL_BYTS .known: .*KVSTORE_AGENT_POOL_BYTES"):  # fmt: skip
        load_config(AgentConfig, env_prefix="KVSTORE_AGENT_")
    monkeypatch.setenv("KVSTORE_ROUTER_WEIGHT_LOD", "3")
    with pytest.raises(ValueError, match="KVSTORE_ROUTER_WEIGHT_LOD"):
        load_config(RouterConfig, env_prefix="KVSTORE_ROUTER_")
    assert load_config(AgentConfig).pool_bytes  # no prefix given: the environment unread


def test_kubernetes_service_links_are_not_settings(monkeypatch):
    """A Service named kvstore-agent puts these in every pod of its namespace (service
    links on); they share the prefix and are not misspelt settings."""
    links = {
        "KVSTORE_AGENT_SERVICE_HOST": "10.96.0.12",
        "KVSTORE_AGENT_SERVICE_PORT": "50051",
        "KVSTORE_AGENT_SERVICE_PORT_GRPC": "50051",
        "KVSTORE_AGENT_PORT": "tcp://10.96.0.12:50051",
        "KVSTORE_AGENT_PORT_50051_TCP": "tcp://10.96.0.12:50051",
        "KVSTORE_AGENT_PORT_50051_TCP_PROTO": "tcp",
        "KVSTORE_AGENT_PORT_50051_TCP_PORT": "50051",
        "KVSTORE_AGENT_PORT_50051_TCP_ADDR": "10.96.0.12",
    }
    for k, v in links.items():
        monkeypatch.setenv(k, v)
    assert load_config(AgentConfig, env_prefix="KVSTORE_AGENT_").listen == AgentConfig().listen
    # A setting misspelt into a link's name, but not of a link's value, is still refused.
    monkeypatch.setenv("KVSTORE_AGENT_METRIC_PORT", "9090")
    with pytest.raises(ValueError, match="KVSTORE_AGENT_METRIC_PORT"):
        load_config(AgentConfig, env_prefix="KVSTORE_AGENT_")


def test_precedence_file_then_env_then_overrides(tmp_path, monkeypatch):
    path = write(tmp_path, "pool_bytes: 16MiB\nnode_id: from-file\ndevice: cpu\n")
    monkeypatch.setenv("KVSTORE_AGENT_POOL_BYTES", "32MiB")
    monkeypatch.setenv("KVSTORE_AGENT_NODE_ID", "from-env")
    cfg = load_config(AgentConfig, path, "KVSTORE_AGENT_", {"pool_bytes": "64MiB", "node_id": None})
    assert cfg.pool_bytes == 64 * MiB  # override beats env beats file
    assert cfg.node_id == "from-env"  # a None override is "not given"
    assert cfg.device == "cpu"  # only in the file
    assert load_config(AgentConfig, path).pool_bytes == 16 * MiB


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("pool_bytes", "lots", "pool_bytes"),
        ("pool_bytes", -5, "pool_bytes"),
        ("slot_bytes", "0", "slot_bytes"),
        ("max_blocks_per_request", "many", "max_blocks_per_request"),
        ("max_blocks_per_request", 0, "max_blocks_per_request"),
        ("max_message_bytes", 0, "max_message_bytes"),
        ("max_message_bytes", "512KiB", r"max_message_bytes \(524288\) must be at least 589824"),
        ("max_concurrent_rpcs", -1, r"max_concurrent_rpcs must be >= 0 \(0: no cap\), got -1"),
        ("max_concurrent_rpcs", "lots", "max_concurrent_rpcs"),
        (
            "max_health_checks_per_peer",
            -2,
            r"max_health_checks_per_peer must be >= 0 \(0: no cap\), got -2",
        ),
        (
            "max_health_checks_per_peer",
            3,
            r"max_health_checks_per_peer must be 0 \(no cap\) or at least 4: .* got 3",
        ),
        ("expire_interval_s", "soon", "expire_interval_s"),
        ("expire_interval_s", 0, "expire_interval_s"),
        ("lease_ttl_s", -1, "lease_ttl_s"),
        ("allow_unauthenticated", "maybe", "allow_unauthenticated"),
        ("eviction", "fifo", "eviction"),
        ("node_id", "a/b", "node_id"),
        ("tenants", {"acme": {"hbm_limit_bytes": "x"}}, r"tenants\.acme\.hbm_limit_bytes"),
        ("tenants", {"acme": {"colour": 1}}, r"unknown tenants\.acme fields: colour"),
        ("tenants", "[1, 2]", "tenants"),
        ("tenants", {"ac me": {}}, "tenants: the name 'ac me' contains whitespace"),
        ("tenants", {"": {}}, "tenants: the name '' is empty"),
        ("tenants", {"a": {"token_sha256": "zz"}}, r"tenants\.a\.token_sha256 must be the 64 hex"),
        (
            "tenants",
            {"acme": {"token_sha256": "ab" * 32}, "globex": {"token_sha256": "AB" * 32}},
            "tenants.acme and tenants.globex have the same token_sha256",
        ),
        ("default_policy", {"ttl_seconds": -1}, "ttl_seconds"),
        ("default_policy", {"min_prefix_blocks": "two"}, r"default_policy\.min_prefix_blocks"),
        ("policies", {"acme/chat": {"persist": "sometimes"}}, r"policies\.acme/chat\.persist"),
        ("colour", "blue", "unknown AgentConfig fields: colour"),
        ("tenant_pin_fraction", 1.5, r"tenant_pin_fraction must be a number from 0 to 1 .*1\.5"),
        ("tenant_pin_fraction", -0.1, "tenant_pin_fraction must be a number from 0 to 1"),
        ("tenant_pin_fraction", "nan", "tenant_pin_fraction must be a number from 0 to 1"),
        ("tenant_pin_fraction", "half", "tenant_pin_fraction"),
        ("keepalive_s", -1, r"keepalive_s must be a number of seconds >= 0, got -1"),
        ("keepalive_s", "nan", "keepalive_s must be a number of seconds >= 0, got nan"),
        ("keepalive_timeout_s", "inf", "keepalive_timeout_s must be a number of seconds"),
        (
            "keepalive_timeout_s",
            0,
            r"keepalive_timeout_s must be at least 1 s while keepalive_s is on \(60\), got 0",
        ),
        ("keepalive_s", 0.001, r"keepalive_s must be 0 \(no pings\) or at least 1 s"),
        ("max_connections", -1, r"max_connections must be >= 0 \(0: no cap\), got -1"),
        ("max_connections", "many", "max_connections"),
        ("handshake_timeout_s", 0.5, r"handshake_timeout_s must be at least 1 s .*got 0\.5"),
        ("handshake_timeout_s", "inf", "handshake_timeout_s must be at least 1 s"),
    ],
)
def test_bad_values_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        load_config(
            AgentConfig, overrides={"pool_bytes": "1MiB", "slot_bytes": "64KiB", field: value}
        )


def test_router_connection_limits_are_checked_as_the_agents():
    with pytest.raises(ValueError, match=r"max_connections must be >= 0 \(0: no cap\), got -5"):
        RouterConfig(max_connections=-5)
    with pytest.raises(ValueError, match=r"handshake_timeout_s must be at least 1 s"):
        RouterConfig(handshake_timeout_s=0)


def test_router_tenant_names_follow_the_same_rule():
    with pytest.raises(ValueError, match="contains '/'"):
        RouterConfig(tenants={"a/b": TenantConfig()})


def test_a_tenant_may_pin_half_the_pool_by_default_in_whole_slots():
    assert AgentConfig(pool_bytes=MiB, slot_bytes=64 << 10).tenant_pin_bytes == MiB // 2
    cfg = load_config(
        AgentConfig,
        overrides={"pool_bytes": "1MiB", "slot_bytes": "64KiB", "tenant_pin_fraction": "0.2"},
    )
    assert cfg.tenant_pin_bytes == 3 * (64 << 10)  # 16 slots x 0.2: 3 whole slots


@pytest.mark.parametrize(
    "settings,match",
    [
        (
            {"local_lane_max_connections_per_tenant": 81},
            r"^local_lane_max_connections_per_tenant must be from 0 \(all but a fifth of "
            r"local_lane_max_connections\) to local_lane_max_connections \(80\), got 81",
        ),
        ({"local_lane_max_connections_per_tenant": -1}, "local_lane_max_connections_per_tenant"),
        (
            {"local_lane_idle_timeout_s": 60, "local_lane_region_idle_timeout_s": 30},
            r"^local_lane_region_idle_timeout_s must be >= local_lane_idle_timeout_s "
            r"\(60\.0\), got 30\.0",
        ),
        ({"local_lane_max_region_bytes": 0}, r"^local_lane_max_region_bytes must be > 0, got 0"),
        (
            {"local_lane_max_region_bytes": "2GiB", "local_lane_max_tenant_region_bytes": "1GiB"},
            r"^local_lane_max_tenant_region_bytes must be 0 \(no cap\) or >= "
            r"local_lane_max_region_bytes "
            r"\(2147483648\), got 1073741824",
        ),
        ({"local_lane_max_tenant_region_bytes": "lots"}, "local_lane_max_tenant_region_bytes"),
    ],
)
def test_lane_caps_are_checked_and_named(settings, match):
    with pytest.raises(ValueError, match=match):
        load_config(AgentConfig, overrides=settings)


def test_lane_region_caps_have_defaults_and_sizes_parse():
    cfg = AgentConfig()
    # 0: all but a fifth of the 80 connections, the 64 a lone tenant had before caps
    assert (cfg.local_lane_max_connections, cfg.local_lane_max_connections_per_tenant) == (80, 0)
    # Staging of up to 64 GiB registers, and a tenant's regions are not capped together
    assert (cfg.local_lane_max_region_bytes, cfg.local_lane_max_tenant_region_bytes) == (
        64 << 30,
        0,
    )
    cfg = load_config(
        AgentConfig,
        overrides={
            "local_lane_max_region_bytes": "64MiB",
            "local_lane_max_tenant_region_bytes": "1GiB",
        },
    )
    assert (cfg.local_lane_max_region_bytes, cfg.local_lane_max_tenant_region_bytes) == (
        64 * MiB,
        1 << 30,
    )


def test_pool_must_hold_a_slot():
    with pytest.raises(ValueError, match="pool_bytes"):
        AgentConfig(pool_bytes=MiB, slot_bytes=2 * MiB)


def test_bad_file_contents(tmp_path):
    with pytest.raises(ValueError, match="mapping"):
        load_config(AgentConfig, write(tmp_path, "- a\n- b\n"))


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n"])
def test_a_file_with_no_settings_is_refused(tmp_path, text):
    """An empty (or broken) ConfigMap mount ran the agent on every default, its data in
    ./kvstore-data under whatever directory it started in, without a word."""
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match=rf"{path}: holds no settings"):
        load_config(AgentConfig, path)


@pytest.mark.parametrize(
    "name, text",
    [("agent.yaml", "pool_bytes: 1GiB\npool_bytes: 2GiB\n"),
     ("agent.json", '{"pool_bytes": "1GiB", "pool_bytes": "2GiB"}'),
     ("agent.yaml", "peer:\n  max_transfers: 2\n  max_transfers: 3\n")],
)  # fmt: skip
def test_a_key_given_twice_is_refused(tmp_path, name, text):
    """The parsers kept the last of two, so an edit above a forgotten line did nothing."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=r"not valid (YAML|JSON).*given twice"):
        load_config(AgentConfig, str(path))


@pytest.mark.parametrize(
    "override, said",
    [({"lease_ttl_s": 2.5}, "lease_ttl_s: expected a whole number, got 2.5"),
     ({"lease_ttl_s": True}, "lease_ttl_s: expected a whole number, got True"),
     ({"etcd_endpoints": ["a:1", "b:2"]}, "etcd_endpoints: expected a string, got a list"),
     ({"node_id": {"a": 1}}, "node_id: expected a string, got a mapping"),
     ({"expire_interval_s": False}, "expire_interval_s: expected a number, got False")],
)  # fmt: skip
def test_values_of_the_wrong_kind_are_refused_not_converted(tmp_path, override, said):
    """2.5 became 2, a list of endpoints became its Python repr ("['a:1'")."""
    path = tmp_path / "agent.json"
    path.write_text(json.dumps(override))
    with pytest.raises(ValueError, match=re.escape(said)):
        load_config(AgentConfig, str(path))


@pytest.mark.parametrize(
    "cls, settings, said",
    [(AgentConfig, {"listen": "127.0.0.1:47111", "metrics_port": 47111},
      "listen and metrics_port both name port 47111"),
     (AgentConfig, {"listen": "127.0.0.1:47112", "peer_port": 47112},
      "listen and peer_port both name port 47112"),
     (AgentConfig, {"metrics_port": 47113, "peer_port": 47113},
      "metrics_port and peer_port both name port 47113"),
     (RouterConfig, {"listen": "127.0.0.1:47114", "metrics_port": 47114},
      "listen and metrics_port both name port 47114")],
)  # fmt: skip
def test_one_process_cannot_name_one_port_twice(cls, settings, said):
    """The second bind failed as if another process held the port (the metrics server
    binds first), or the UCX listener went down saying 'Device is busy'."""
    with pytest.raises(ValueError, match=said):
        load_config(cls, None, None, settings)
    load_config(cls, None, None, {**settings, "metrics_port": 0, "peer_port": 0}
                if cls is AgentConfig else {**settings, "metrics_port": 0})  # fmt: skip


@pytest.mark.parametrize("value", [0, -1, float("nan")])
def test_a_router_inflight_timeout_must_be_positive(value):
    with pytest.raises(ValueError, match="inflight_timeout_s must be a number of seconds > 0"):
        RouterConfig(inflight_timeout_s=value)


def test_an_unreadable_or_unparsable_file_is_named(tmp_path):
    """The operator learns which file is broken, not just a parser's line and column."""
    bad = tmp_path / "router.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match=rf"{bad}: not valid JSON: Expecting property name"):
        load_config(RouterConfig, str(bad))
    bad_yaml = tmp_path / "agent.yaml"
    bad_yaml.write_text("pool_bytes: [1\n")
    with pytest.raises(ValueError, match=rf"{bad_yaml}: not valid YAML"):
        load_config(AgentConfig, str(bad_yaml))
    missing = tmp_path / "none.yaml"
    with pytest.raises(ValueError, match=rf"{missing}: cannot read: No such file"):
        load_config(AgentConfig, str(missing))
    latin = tmp_path / "agent.yaml"
    latin.write_bytes(b"node_id: gr\xfcn\n")  # was a codec error naming no file
    with pytest.raises(ValueError, match=rf"{latin}: not UTF-8 text \(byte 11"):
        load_config(AgentConfig, str(latin))


@pytest.mark.parametrize("name", ["agent.YAML", "agent.Yml", "agent.conf"])
def test_yaml_files_of_any_other_name_are_read_as_yaml(tmp_path, name):
    """Only .json is JSON: an upper-case .YAML or a .conf file was parsed as JSON
    ("not valid JSON")."""
    f = tmp_path / name
    f.write_text("node_id: gpu-7\n")
    assert load_config(AgentConfig, str(f)).node_id == "gpu-7"


def test_router_config_validation():
    assert load_config(RouterConfig, overrides={"weight_load": "2"}).weight_load == 2.0
    with pytest.raises(ValueError, match="weight_load"):
        RouterConfig(weight_load=-1)
    with pytest.raises(ValueError, match="peer_gbps"):
        RouterConfig(peer_gbps=0)


def test_peer_section_merges_file_env_and_overrides_field_by_field(tmp_path, monkeypatch):
    path = write(tmp_path, "peer:\n  batch_bytes: 64MiB\n  max_transfers: 2\n  io_timeout_s: 4\n")
    assert load_config(AgentConfig, path).peer == PeerConfig(
        batch_bytes=64 * MiB, max_transfers=2, io_timeout_s=4
    )
    # The KVSTORE_PEER_<FIELD> variables operators and benchmarks set are the env layer;
    # sizes parse as everywhere else.
    monkeypatch.setenv("KVSTORE_PEER_BATCH_BYTES", "32MiB")
    monkeypatch.setenv("KVSTORE_PEER_IN_PLACE", "0")
    monkeypatch.setenv("KVSTORE_AGENT_PEER", '{"connect_timeout_s": 1.5}')
    cfg = load_config(AgentConfig, path, "KVSTORE_AGENT_", {"peer": {"max_transfers": 3}})
    assert cfg.peer == PeerConfig(
        batch_bytes=32 * MiB, max_transfers=3, io_timeout_s=4, connect_timeout_s=1.5, in_place=False
    )
    assert cfg.peer.batch_for(2 * MiB) == 16
    assert load_config(AgentConfig, overrides=to_dict(cfg)) == cfg
    assert AgentConfig().peer == PeerConfig()


@pytest.mark.parametrize(
    "var,value,match",
    [
        ("KVSTORE_PEER_IN_PLACE", "flase", "KVSTORE_PEER_IN_PLACE: expected a boolean, got 'f"),
        ("KVSTORE_PEER_SHARED_MEMORY", "", "KVSTORE_PEER_SHARED_MEMORY: expected a boolean"),
        ("KVSTORE_PEER_BATCH_BYTES", "lots", "KVSTORE_PEER_BATCH_BYTES: "),
        ("KVSTORE_PEER_BATCH_BYTES", "0", r"peer\.batch_bytes must be >= 1"),
        ("KVSTORE_PEER_STAGING_SETS", "2", r"peer\.staging_sets must be >= 3"),
        ("KVSTORE_PEER_UCX_NET_DEVICES", "", r"peer\.ucx_net_devices must be \"auto\""),
        ("KVSTORE_PEER_UCX_NET_DEVICES", "eth0 ;rm", r"got 'eth0 ;rm'"),
        ("KVSTORE_PEER_UCX_NET_DEVICES", "eth0,,lo", r"peer\.ucx_net_devices must be"),
        ("KVSTORE_PEER_IO_TIMEOUT_S", "soon", "KVSTORE_PEER_IO_TIMEOUT_S: "),
        (
            "KVSTORE_PEER_INPLACE",
            "0",
            "unknown peer settings in the environment: KVSTORE_PEER_INPLACE",
        ),
    ],
)
def test_bad_peer_env_is_an_error_naming_it(monkeypatch, var, value, match):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=match):
        load_config(AgentConfig, env_prefix="KVSTORE_AGENT_")


def test_bad_peer_file_values_name_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"unknown peer fields: colour"):
        load_config(AgentConfig, write(tmp_path, "peer:\n  colour: blue\n"))
    with pytest.raises(ValueError, match=r"peer: expected a mapping"):
        load_config(AgentConfig, write(tmp_path, "peer: 5\n"))
    with pytest.raises(ValueError, match=r"peer\.max_transfers must be >= 1"):
        load_config(AgentConfig, overrides={"peer": {"max_transfers": 0}})


def test_encryption_section_from_file_and_env(tmp_path, monkeypatch):
    path = write(tmp_path, "encryption:\n  enabled: true\n  keys_dir: /keys\n")
    monkeypatch.setenv("KVSTORE_ENCRYPTION_ACTIVE", '{"acme": 2}')
    enc = load_config(AgentConfig, path, "KVSTORE_AGENT_").encryption
    assert (enc.enabled, enc.keys_dir, enc.active) == (True, "/keys", {"acme": 2})
    assert not load_config(AgentConfig).encryption.enabled  # off unless asked for


@pytest.mark.parametrize(
    "section, match",
    [
        ({"enabled": True}, r"encryption\.keys_dir must be set"),
        ({"active": {"acme": 0}}, r"encryption\.active\.acme must be 1\.\.4294967295"),
        ({"active": {"acme": "two"}}, r"encryption\.active\.acme"),
        ({"colour": "blue"}, r"unknown encryption fields: colour"),
    ],
)
def test_bad_encryption_settings_name_the_field(section, match):
    with pytest.raises(ValueError, match=match):
        load_config(AgentConfig, overrides={"encryption": section})


def test_keepalive_can_be_turned_off_and_is_checked_on_routers_too():
    base = {"pool_bytes": "1MiB", "slot_bytes": "64KiB"}
    off = load_config(AgentConfig, overrides={**base, "keepalive_s": 0, "keepalive_timeout_s": 0})
    assert (off.keepalive_s, off.keepalive_timeout_s) == (0, 0)
    assert keepalive_options(off.keepalive_s, off.keepalive_timeout_s) == []
    on = dict(keepalive_options(1.5, 0.25))
    assert on["grpc.keepalive_time_ms"] == 1500 and on["grpc.keepalive_timeout_ms"] == 250
    assert on["grpc.http2.max_pings_without_data"] == 0  # pings go on while nothing is sent
    with pytest.raises(ValueError, match=r"keepalive_timeout_s must be at least 1 s while"):
        load_config(RouterConfig, overrides={"keepalive_timeout_s": 0})


@pytest.mark.parametrize(
    "setting,host,devices",
    [
        ("auto", "127.0.0.1", "lo"),
        ("auto", "::1", "lo"),
        ("auto", "localhost", "lo"),
        ("auto", "[::1]", "lo"),  # as the agent passes an IPv6 listen host
        ("auto", "::ffff:127.0.0.1", "lo"),
        ("auto", "no-such-host.invalid", ""),  # unresolvable: every device, as UCX's default
        ("^eth0", "127.0.0.1", "^eth0"),
        ("auto", "0.0.0.0", ""),  # every device: peers on other hosts
        ("auto", "10.0.0.7", ""),
        ("all", "127.0.0.1", ""),
        ("eth1,mlx5_0:1", "0.0.0.0", "eth1,mlx5_0:1"),
    ],
)
def test_ucx_net_devices_keep_a_loopback_agents_transports_on_loopback(setting, host, devices):
    from node_agent.peer.ucx.bind import net_devices

    assert PeerConfig(ucx_net_devices=setting).ucx_net_devices == setting
    assert net_devices(setting, host) == devices
