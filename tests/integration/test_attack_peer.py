"""Peers prove they are agents (issue 18, item 4): an agent configured with the agent
credential (`agent_token_file`, identity "_agent") presents it when it pulls from a
registered agent, and never to a listener a caller named in its Prefetch; the router's
cluster token moves no blocks (test_attack_tenant.py). "Registered" means a `nodes/`
record signed with the agent token: anyone who can write etcd can put a record there, and
a forged or replayed one earns its listener nothing (node_agent/peer/credential.py). Real
etcd (plaintext and mTLS) and agent processes."""

from __future__ import annotations

import hashlib
import json
import subprocess

import grpc
import pytest

from support.attack import (
    TOKENS,
    As,
    TokenTrap,
    etcd_items,
    etcd_put,
    ns_msg,
    put_chain,
    ref,
    refusal,
    tenants,
)
from support.cluster import agent_config
from support.common import (
    PY,
    ROOT,
    TEST_SECRET,
    free_port,
    block_payload,
    make_namespace,
    prompt_tokens,
    ucx_dial,
    wait_for,
)

from kvstore.client import KVClient
from kvstore.coord.etcd import NodeRecord
from kvstore.hashing import hash_chain, pack_ids
from kvstore.v1 import agent_pb2, peer_pb2

SPEC = make_namespace(tenant="acme", name="pulled")
MINE = make_namespace(tenant="globex", name="mine")
BS = SPEC.block_size
N = 4


def _agent_token(tmp_path) -> dict:
    """The config of an agent holding the agent credential, authenticating everyone."""
    token_file = tmp_path / "agent-token"
    token_file.write_text(TOKENS["_agent"] + "\n")
    return dict(allow_unauthenticated=False, agent_token_file=str(token_file))


def _holder_tenants() -> dict:
    """The tenants of an agent that knows acme by another token than the puller does: a
    pull that forwarded acme's token is UNAUTHENTICATED there, one with the agent
    credential is served."""
    t = tenants()
    t["acme"] = {"token_sha256": hashlib.sha256(b"acme-on-holder").hexdigest()}
    return t


def _acme_blocks_on(holder, tls=None) -> tuple[list[bytes], bytes, list[bytes]]:
    """acme's N private blocks put on `holder`: (ids, root, payloads)."""
    root = SPEC.root(0, TEST_SECRET)
    ids = hash_chain(root, prompt_tokens(9, N * BS), BS)
    blocks = [block_payload(i, SPEC.block_bytes) for i in ids]
    owner = As(holder.address, None, tls)
    owner.md = (("authorization", "Bearer acme-on-holder"),)
    owner.call(owner.agent.OpenNamespace, agent_pb2.OpenNamespaceRequest(spec=ns_msg(SPEC)))
    put = agent_pb2.PutRequest(ns=ref(SPEC), root=root)
    for k, (bid, data) in enumerate(zip(ids, blocks)):
        put.blocks.add(block_id=bid, parent_id=ids[k - 1] if k else root, data=data)
    assert owner.call(owner.agent.Put, iter([put])).stored == N
    owner.close()
    return ids, root, blocks


def _pulls_as_an_agent(puller, holder, ids, root, blocks, tls=None) -> None:
    """acme asks `puller` to pull its blocks from `holder`: served only when the puller
    shows the agent credential (the holder knows acme by another token); waits until the
    puller has followed nodes/ that far."""
    acme = As(puller.address, "acme", tls)
    acme.call(acme.agent.OpenNamespace, agent_pb2.OpenNamespaceRequest(spec=ns_msg(SPEC)))
    wait_for(
        lambda: acme.prefetch(SPEC, ids, root, holder.address).present == N,
        30,
        what="the puller to pull as an agent",
    )
    got = acme.call(
        acme.agent.Get,
        agent_pb2.GetRequest(ns=ref(SPEC), block_ids=pack_ids(ids), parent_id=root),
    )
    assert [bytes(d) for m in got for d in m.data] == blocks
    acme.close()


def _globex_prefetches_from(puller, traps, tls=None) -> None:
    """globex asks `puller` to fill its own namespace from each trap: every trap sees
    globex's own token, never the agent's."""
    g = As(puller.address, "globex", tls)
    g.call(g.agent.OpenNamespace, agent_pb2.OpenNamespaceRequest(spec=ns_msg(MINE)))
    root = MINE.root(0, b"globex-secret")
    ids = hash_chain(root, prompt_tokens(1, 2 * BS), BS)
    for trap in traps:
        assert g.prefetch(MINE, ids, root, trap.address).present == 0
        assert trap.seen and set(trap.seen) == {f"Bearer {TOKENS['globex']}"}, trap.seen
    g.close()


def _captured_reads_nothing(holder, traps, ids, root, tls=None) -> None:
    """What the traps captured reads none of acme's blocks on `holder` (the agent token
    itself would: the control)."""
    thief = As(holder.address, None, tls)
    for stolen in {s for t in traps for s in t.seen}:
        thief.md = (("authorization", stolen),)
        assert refusal(thief.fetch, SPEC, ids, root)[0] == grpc.StatusCode.PERMISSION_DENIED
    thief.md = (("authorization", f"Bearer {TOKENS['_agent']}"),)
    assert sum(len(m.data) for m in thief.fetch(SPEC, ids, root)) == N
    thief.close()


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
    ids, root, blocks = _acme_blocks_on(holder)
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


def test_forged_node_records_earn_their_listener_no_agent_credential(etcd, spawn_agent, tmp_path):
    """globex, able to write etcd (the dev cluster's client pair can; no RBAC), puts
    `nodes/evil` naming a listener of its own, and replays a stopped agent's signed record
    with the address changed to another listener of its own; then it asks an agent to
    prefetch globex's OWN namespace from them. The listeners see globex's token, not the
    agent's, and what they captured reads none of acme's blocks."""
    common = _agent_token(tmp_path)
    puller = spawn_agent(**agent_config(etcd, tenants=tenants(), **common))  # agent-0
    gone = spawn_agent(**agent_config(etcd, tenants=tenants(), **common))  # agent-1
    wait_for(lambda: "nodes/agent-1" in etcd_items(etcd.endpoint), 30, what="agent-1 in etcd")
    signed = json.loads(etcd_items(etcd.endpoint)["nodes/agent-1"])
    gone.stop()  # its lease is revoked: the record goes
    wait_for(lambda: "nodes/agent-1" not in etcd_items(etcd.endpoint), 30, what="agent-1 gone")

    forged, replayed = TokenTrap(), TokenTrap()
    try:
        etcd_put(etcd.endpoint, "nodes/evil", NodeRecord("evil", forged.address).to_json())
        replay = {**signed, "address": replayed.address}
        etcd_put(etcd.endpoint, "nodes/agent-1", json.dumps(replay).encode())
        # An agent registering after the forgeries: once the puller shows it the agent
        # credential, it has followed nodes/ past them (a watch delivers in order).
        holder = spawn_agent(**agent_config(etcd, tenants=_holder_tenants(), **common))
        ids, root, blocks = _acme_blocks_on(holder)
        _pulls_as_an_agent(puller, holder, ids, root, blocks)
        _globex_prefetches_from(puller, (forged, replayed))
        _captured_reads_nothing(holder, (forged, replayed), ids, root)
    finally:
        forged.close()
        replayed.close()


def test_agents_on_a_tls_etcd_show_each_other_the_agent_credential_and_no_one_else(
    spawn_agent, pki, tls_etcd, tmp_path
):
    """With etcd on mTLS the agents follow nodes/ over the agent's own TLS settings, so
    pulls between them carry the agent credential; a record forged with the client pair
    (which etcd lets write anything) earns a listener holding a certificate of the
    cluster's CA nothing."""
    common = dict(
        _agent_token(tmp_path), etcd_endpoints=tls_etcd.endpoint, lease_ttl_s=2, **pki.section()
    )
    trap = TokenTrap(pki.server)
    try:
        record = NodeRecord("evil", trap.address).to_json()
        etcd_put(tls_etcd.endpoint, "nodes/evil", record, pki.client)
        puller = spawn_agent(tenants=tenants(), peer_port=free_port(), **common)
        holder = spawn_agent(tenants=_holder_tenants(), peer_port=free_port(), **common)
        ids, root, blocks = _acme_blocks_on(holder, pki.client)
        _pulls_as_an_agent(puller, holder, ids, root, blocks, pki.client)
        _globex_prefetches_from(puller, (trap,), pki.client)
        _captured_reads_nothing(holder, (trap,), ids, root, pki.client)
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
    assert put_chain(agent, spec, ids, root).stored == len(ids)


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


BIG_ACME = make_namespace(tenant="acme", name="direct", num_layers=32, num_kv_heads=8, head_dim=128)


def _direct_header(holder, who: str, ids: list[bytes], root: bytes) -> dict:
    """The first chunk header of a UCX fetch of acme's `ids` on `holder` with `who`'s
    token, offering direct reads as an agent of this host would (tests/support/ucx_dial.py)."""
    req = peer_pb2.FetchRequest(
        ns=ref(BIG_ACME),
        spec=ns_msg(BIG_ACME),
        block_ids=pack_ids(ids),
        parent_id=root,
        authorization=f"Bearer {TOKENS[who]}",
    )
    port = str(holder.config["peer_port"])
    return ucx_dial("127.0.0.1", port, "header", req.SerializeToString().hex())


def test_direct_reads_name_the_agents_memory_to_the_agent_credential_only(spawn_agent):
    """A direct-read header names the serving agent's process, its pool's descriptor and
    the address of every block: a same-host tenant offering the host's identity (anyone
    on the host can compute it) learned them with its own token, which helps aim a write
    through UCX's unauthenticated ports (an attacker probe, 2026-12-07). Where agents have
    a credential of their own, only a caller presenting it gets direct reads; a tenant's
    pull gets its blocks as UCX messages. Without an agent identity (the control), every
    caller is offered them, as before."""
    big = dict(allow_unauthenticated=False, slot_bytes="2MiB", pool_bytes="64MiB")
    without_agent = {t: v for t, v in tenants().items() if t != "_agent"}
    for table, tenant_gets_direct in ((tenants(), False), (without_agent, True)):
        holder = spawn_agent(tenants=table, peer_port=free_port(), **big)
        root = BIG_ACME.root(0, TEST_SECRET)
        ids = hash_chain(root, prompt_tokens(31, 2 * BIG_ACME.block_size), BIG_ACME.block_size)
        acme = As(holder.address, "acme")
        acme.call(acme.agent.OpenNamespace, agent_pb2.OpenNamespaceRequest(spec=ns_msg(BIG_ACME)))
        assert put_chain(acme, BIG_ACME, ids, root).stored == 2
        acme.close()
        got = _direct_header(holder, "acme", ids, root)
        assert (got["error"], got["count"]) == ("", 2), got
        if tenant_gets_direct:
            assert (got["direct_pid"], got["addresses"]) == (holder.proc.pid, 2), got
        else:
            assert (got["direct_pid"], got["addresses"], got["direct_fd"]) == (0, 0, 0), got
            agent = _direct_header(holder, "_agent", ids, root)
            assert (agent["direct_pid"], agent["addresses"]) == (holder.proc.pid, 2), agent
            with KVClient(holder.address, token=TOKENS["_cluster"], use_shm=False) as c:
                counted = dict(c.stats().counters)
            assert counted.get("peer_direct_withheld") == 1, counted
