"""Peers prove they are agents (issue 18, item 4): an agent configured with the agent
credential (`agent_token_file`, identity "_agent") presents it when it pulls from a
registered agent, and never to a listener a caller named in its Prefetch; the router's
cluster token moves no blocks (test_attack_tenant.py). Real etcd and agent processes."""

from __future__ import annotations

import hashlib
import json
import subprocess

import pytest

from support.attack import TOKENS, As, TokenTrap, etcd_items, ns_msg, ref, tenants
from support.cluster import agent_config
from support.common import (
    PY,
    ROOT,
    TEST_SECRET,
    free_port,
    block_payload,
    make_namespace,
    prompt_tokens,
    wait_for,
)

from kvstore.hashing import hash_chain, pack_ids
from kvstore.v1 import agent_pb2, peer_pb2

SPEC = make_namespace(tenant="acme", name="pulled")
BS = SPEC.block_size
N = 4


def test_pulls_show_the_agent_credential_to_registered_agents_only(etcd, spawn_agent, tmp_path):
    token_file = tmp_path / "agent-token"
    token_file.write_text(TOKENS["_agent"] + "\n")
    # The holder knows acme by another token than the puller does: a pull that forwarded
    # acme's token would be UNAUTHENTICATED there, one with the agent credential is served.
    holder_tenants = tenants()
    holder_tenants["acme"] = {"token_sha256": hashlib.sha256(b"acme-on-holder").hexdigest()}
    common = dict(allow_unauthenticated=False, agent_token_file=str(token_file))
    holder = spawn_agent(**agent_config(etcd, tenants=holder_tenants, **common))
    puller = spawn_agent(**agent_config(etcd, tenants=tenants(), **common))
    root = SPEC.root(0, TEST_SECRET)
    ids = hash_chain(root, prompt_tokens(9, N * BS), BS)
    blocks = [block_payload(i, SPEC.block_bytes) for i in ids]
    owner = As(holder.address, None)
    owner.md = (("authorization", "Bearer acme-on-holder"),)
    owner.call(owner.agent.OpenNamespace, agent_pb2.OpenNamespaceRequest(spec=ns_msg(SPEC)))
    put = agent_pb2.PutRequest(ns=ref(SPEC), root=root)
    for k, (bid, data) in enumerate(zip(ids, blocks)):
        put.blocks.add(block_id=bid, parent_id=ids[k - 1] if k else root, data=data)
    assert owner.call(owner.agent.Put, iter([put])).stored == N
    wait_for(
        lambda: sum(k.startswith("nodes/") for k in etcd_items(etcd.endpoint)) == 2,
        30,
        what="both agents registered in etcd",
    )
    acme = As(puller.address, "acme")
    acme.call(
        acme.agent.OpenNamespace,
        agent_pb2.OpenNamespaceRequest(spec=ns_msg(SPEC)),
    )

    # A registered agent's address: the agent credential is shown, the blocks arrive (once
    # the puller has followed nodes/ that far).
    def pulled() -> int:
        return acme.prefetch(SPEC, ids, root, holder.address).present

    wait_for(lambda: pulled() == N, 30, what="the puller to pull as an agent")
    got = acme.call(
        acme.agent.Get,
        agent_pb2.GetRequest(ns=ref(SPEC), block_ids=pack_ids(ids), parent_id=root),
    )
    assert [bytes(d) for m in got for d in m.data] == blocks

    # A listener the caller names: it sees the caller's own token, never the agent's.
    trap = TokenTrap()
    try:
        other = hash_chain(root, prompt_tokens(10, N * BS), BS)
        r = acme.prefetch(SPEC, other, root, trap.address)
        assert r.present == 0
        assert trap.seen and set(trap.seen) == {f"Bearer {TOKENS['acme']}"}
    finally:
        trap.close()


@pytest.mark.parametrize("content", [None, ""], ids=["missing", "empty"])
def test_agent_with_an_unusable_agent_token_file_exits_1_naming_it(tmp_path, content):
    path = tmp_path / "agent-token"
    if content is not None:
        path.write_text(content)
    cfg = tmp_path / "agent.json"
    cfg.write_text(
        json.dumps(
            {
                "listen": "127.0.0.1:0",
                "device": "cpu",
                "pool_bytes": "4MiB",
                "slot_bytes": "64KiB",
                "nvme_bytes": 0,
                "data_dir": str(tmp_path / "data"),
                "allow_unauthenticated": True,
                "agent_token_file": str(path),
            }
        )
    )
    r = subprocess.run(
        [PY, "-m", "node_agent", "--config", str(cfg)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1, r.stderr
    assert f"kvstore-agent: cannot start: agent_token_file {path}" in r.stderr
    assert "Traceback" not in r.stderr


def _put_as(agent: As, spec, ids: list[bytes], root: bytes) -> None:
    agent.call(agent.agent.OpenNamespace, agent_pb2.OpenNamespaceRequest(spec=ns_msg(spec)))
    put = agent_pb2.PutRequest(ns=ref(spec), root=root)
    for k, bid in enumerate(ids):
        put.blocks.add(
            block_id=bid,
            parent_id=ids[k - 1] if k else root,
            data=block_payload(bid, spec.block_bytes),
        )
    assert agent.call(agent.agent.Put, iter([put])).stored == len(ids)


def test_one_tenants_stalled_transfers_leave_slots_for_the_others(spawn_agent):
    """acme connects to B's UCX listener itself and asks for its own blocks, one per
    chunk, on 2 connections, reading each first header and then no payload: each
    transfer holds one of B's transfer slots until io_timeout_s. With B's 2 slots both
    held, globex's pull from B waited past its deadline (present 0); one tenant now
    takes at most all but one slot, so globex's pull is served meanwhile."""
    big = dict(num_layers=32, num_kv_heads=8, head_dim=128)  # 2 MiB blocks: rendezvous
    mine = make_namespace(tenant="acme", name="stall", **big)
    theirs = make_namespace(tenant="globex", name="pulled", **big)
    cfg = dict(
        allow_unauthenticated=False,
        tenants=tenants(),
        slot_bytes="2MiB",
        pool_bytes="64MiB",
        nvme_bytes=0,
        peer={"max_transfers": 2, "io_timeout_s": 60},
    )
    b_port = free_port()
    b = spawn_agent(peer_port=b_port, **cfg)
    a = spawn_agent(peer_port=free_port(), **cfg)
    acme_b, globex_b = As(b.address, "acme"), As(b.address, "globex")
    acme_root, globex_root = mine.root(0, TEST_SECRET), theirs.root(0, TEST_SECRET)
    acme_ids = hash_chain(acme_root, prompt_tokens(21, 8 * BS), BS)
    globex_ids = hash_chain(globex_root, prompt_tokens(22, N * BS), BS)
    _put_as(acme_b, mine, acme_ids, acme_root)
    _put_as(globex_b, theirs, globex_ids, globex_root)
    req = peer_pb2.FetchRequest(
        ns=ref(mine),
        block_ids=pack_ids(acme_ids),
        parent_id=acme_root,
        batch_blocks=1,
        authorization=f"Bearer {TOKENS['acme']}",
    )
    dial = ROOT / "tests" / "support" / "ucx_dial.py"
    stall = subprocess.Popen(
        [PY, str(dial), "127.0.0.1", str(b_port), "hold", "2", req.SerializeToString().hex()],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert stall.stdout is not None
        line = stall.stdout.readline()
        held = json.loads(line)["held"]  # transfers served, then stalled
        assert held >= 1, line
        globex_a = As(a.address, "globex")
        globex_a.call(
            globex_a.agent.OpenNamespace, agent_pb2.OpenNamespaceRequest(spec=ns_msg(theirs))
        )
        r = globex_a.prefetch(theirs, globex_ids, globex_root, b.address)  # 5 s deadline
        assert r.present == N, r
    finally:
        stall.kill()
        stall.wait(10)
