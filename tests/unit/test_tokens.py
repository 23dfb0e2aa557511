"""node_agent/tokens.TokenTable: the one bearer-token rule of the gRPC edge and the UCX
peer path (tests/integration/test_agent.py and test_peer.py exercise both through real agents)."""

from __future__ import annotations

import hashlib

import pytest

from kvstore import errors
from kvstore.config import AgentConfig, TenantConfig
from node_agent.tokens import TokenTable


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def test_a_token_names_the_tenant_its_hash_belongs_to():
    table = TokenTable(
        {"acme": sha("acme-token").upper(), "globex": sha("g"), "none": ""},
        allow_unauthenticated=False,
    )
    assert table.tenant("Bearer acme-token") == "acme"  # hashes compare case-insensitively
    assert table.tenant("Bearer  g ") == "globex"  # the token is stripped
    for bad, match in (
        ("", "missing 'authorization: Bearer <token>'"),
        ("Basic acme-token", "must be 'Bearer <token>'"),
        ("Bearer nobody", "unknown token"),
        ("Bearer ", "unknown token"),
    ):
        with pytest.raises(errors.Unauthenticated, match=match):
            table.tenant(bad)


def test_unauthenticated_requests_only_where_allowed():
    cfg = AgentConfig(
        tenants={"acme": TenantConfig(token_sha256=sha("t"))}, allow_unauthenticated=True
    )
    table = TokenTable.from_config(cfg)
    assert table.tenant("") is None
    assert table.tenant("Bearer t") == "acme"
    with pytest.raises(errors.Unauthenticated, match="unknown token"):
        table.tenant("Bearer other")  # a token given is checked even then
