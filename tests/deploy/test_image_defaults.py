"""The image's default configuration (deploy/docker/*.yaml, copied to /etc/kvstore/): it
loads as the processes load it, and listens where a container must (every interface, so a
port mapping reaches it), with its data under the volume path."""

from __future__ import annotations

from pathlib import Path

from kvstore.config import AgentConfig, RouterConfig, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_default_agent_config_suits_a_container():
    cfg = load_config(AgentConfig, str(ROOT / "deploy/docker/agent.yaml"), "KVSTORE_AGENT_", {})
    assert cfg.listen.startswith("0.0.0.0:") and cfg.data_dir.startswith("/var/lib/kvstore/")
    assert not cfg.allow_unauthenticated  # secure by default: tenants must be configured


def test_default_router_config_suits_a_container():
    cfg = load_config(RouterConfig, str(ROOT / "deploy/docker/router.yaml"), "KVSTORE_ROUTER_", {})
    assert cfg.listen.startswith("0.0.0.0:")
    assert not cfg.allow_unauthenticated  # like the agents: tenants must be configured


def test_the_dockerfile_ships_both_defaults_where_the_command_reads_them():
    text = (ROOT / "Dockerfile").read_text()
    assert "COPY deploy/docker/agent.yaml deploy/docker/router.yaml /etc/kvstore/" in text
    assert 'CMD ["kvstore-agent", "--config", "/etc/kvstore/agent.yaml"]' in text
