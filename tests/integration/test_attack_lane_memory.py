"""Attacks on the local lane's shared-memory registration and its connection slots, each
against a real agent process and real memfds (docs/security.md, "The local lane"):

- a tenant handed the agent a sparse memfd (2 GiB costing it nothing) that the agent
  then allocated by mapping it populated, on its event loop: now memory whose pages are
  not all allocated is refused, a region's size and a tenant's registered bytes on the
  agent are capped, and the mapping runs on a worker thread;
- one tenant held every lane connection (a 4 KiB region on each keeps it open): now a
  tenant holds at most its share, a connection that never authenticates makes room for
  one that does, and a connection holding a region is closed after a long idle time (the
  client registers again on its next call);
- another tenant's region id answered differently from an unknown one: now both are
  the one unknown-region answer."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import select
import socket
from pathlib import Path

import grpc
import pytest
import torch
from support.common import make_namespace, proc_status_bytes, prompt_tokens, wait_for
from support.lane_raw import closed, connect, read_frame

from kvstore import lane
from kvstore.client import KVClient
from kvstore.client.convert import block_shape, torch_dtype
from kvstore.integrations.vllm_agent import AgentLink
from kvstore.integrations.vllm_config import ConnectorSettings
from kvstore.v1 import agent_pb2

SPEC_A = make_namespace(tenant="acme", name="chat")
SPEC_B = make_namespace(tenant="beta", name="chat")
BS = SPEC_A.block_size
TOKENS = {"acme": "acme-token", "beta": "beta-token", "_cluster": "cluster-token"}
A_MD = (("authorization", "Bearer " + TOKENS["acme"]),)
B_MD = (("authorization", "Bearer " + TOKENS["beta"]),)
MiB = 1 << 20
# The one refusal of RegisterShm on which a client from before the lane caps (5de7ab9,
# KVClient._try_shm) goes without shared memory instead of raising from KVClient().
OLD_CLIENTS_FALL_BACK_ON = grpc.StatusCode.FAILED_PRECONDITION


def code(sc: grpc.StatusCode) -> int:
    return sc.value[0]


def secure_agent(spawn_agent, **cfg):
    tenants = {
        t: {"token_sha256": hashlib.sha256(tok.encode()).hexdigest()} for t, tok in TOKENS.items()
    }
    return spawn_agent(allow_unauthenticated=False, tenants=tenants, **cfg)


def lane_path(agent) -> str:
    return re.findall(r"local lane on (\S+)", agent.log)[-1]


def memfd(size: int, allocate: tuple[int, int] | None = (0, -1)) -> int:
    """A memfd of `size` bytes sealed against shrinking; `allocate`: the (offset, length)
    whose pages are allocated (length -1: to the end; None: none, a sparse file)."""
    fd = os.memfd_create("attack", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if allocate is not None:
        off, n = allocate
        os.posix_fallocate(fd, off, size - off if n < 0 else n)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd


def register(s: socket.socket, fd: int, size: int, meta=B_MD) -> tuple[int, bytes]:
    req = agent_pb2.RegisterShmRequest(size=size).SerializeToString()
    socket.send_fds(s, [lane.request_frame(lane.REGISTER, lane.encode_meta(meta), req)], [fd])
    return read_frame(s)


def region_id(body: bytes) -> int:
    return agent_pb2.RegisterShmResponse.FromString(body).region_id


def counters(agent) -> dict:
    with KVClient(agent.address, token=TOKENS["_cluster"], use_shm=False) as op:
        return dict(op.stats().counters)


def blocks_for(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape, dtype = block_shape(SPEC_A), torch_dtype(SPEC_A.kv_dtype)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(n)]


# ------------------------------------------------------------------ F1: memory nobody paid for
def test_sparse_memory_is_refused_and_the_agent_allocates_none_of_it(spawn_agent):
    """Before the fix a 64 MiB sparse memfd (the probe used 2 GiB) was registered, and the
    agent's populated mapping allocated all of it, charged to the agent. Now memory whose
    pages are not all allocated (none, or only the part past what the region would map)
    is INVALID_ARGUMENT, and the agent's shared memory does not grow; the same memory
    allocated, as the client's staging is (posix_fallocate), registers."""
    agent = secure_agent(spawn_agent)
    path = lane_path(agent)
    size = 64 * MiB
    sparse, tail_only, paid = memfd(size, None), memfd(2 * size, (size, -1)), memfd(size)
    before = proc_status_bytes(agent.proc.pid, "RssShmem")
    try:
        s, (greeting, _) = connect(path)
        with s:
            assert greeting == lane.OK
            for fd in (sparse, tail_only):
                status, body = register(s, fd, size)
                assert status == code(grpc.StatusCode.INVALID_ARGUMENT), body
                assert b"allocated" in body, body
            assert proc_status_bytes(agent.proc.pid, "RssShmem") - before < 16 * MiB
            status, body = register(s, paid, size)
            assert status == lane.OK, body
    finally:
        for fd in (sparse, tail_only, paid):
            os.close(fd)


def test_a_region_and_a_tenants_registered_bytes_are_capped(spawn_agent):
    """local_lane_max_region_bytes and local_lane_max_tenant_region_bytes: a region
    over the first, and a tenant's regions on the agent together (over any number of
    connections) past the second, are FAILED_PRECONDITION, the code on which clients,
    old ones too, take "no shared memory" and go on over gRPC (they re-raised the
    INVALID_ARGUMENT and RESOURCE_EXHAUSTED these were at first); another tenant is not
    held back by it, and bytes come back when their connection closes."""
    agent = secure_agent(
        spawn_agent,
        local_lane_max_region_bytes="4MiB",
        local_lane_max_tenant_region_bytes="8MiB",
    )
    path = lane_path(agent)
    big, fd = memfd(8 * MiB), memfd(4 * MiB)
    try:
        s1, _ = connect(path)
        s2, _ = connect(path)
        with s1, s2:
            status, body = register(s1, big, 8 * MiB)
            assert status == code(OLD_CLIENTS_FALL_BACK_ON), body
            assert b"local_lane_max_region_bytes" in body, body
            assert register(s1, fd, 4 * MiB)[0] == lane.OK
            assert register(s2, fd, 4 * MiB)[0] == lane.OK
            status, body = register(s2, fd, 4 * MiB)
            assert status == code(OLD_CLIENTS_FALL_BACK_ON), body
            assert b"local_lane_max_tenant_region_bytes" in body, body
            a, _ = connect(path)
            with a:
                assert register(a, fd, 4 * MiB, A_MD)[0] == lane.OK  # acme: its own room
            s1.close()  # beta's first region goes with its connection
            wait_for(lambda: register(s2, fd, 4 * MiB)[0] == lane.OK, what="room given back")
    finally:
        os.close(big)
        os.close(fd)


HOLD_MAPPING = Path(__file__).resolve().parents[1] / "support" / "hold_mapping"


def test_the_agent_answers_other_calls_while_it_maps_a_region(spawn_agent, tmp_path, monkeypatch):
    """Before the fix the populated mapping ran on the agent's event loop: nothing else
    was answered until it was done (4.8 s for the probe's 2 GiB; its etcd lease
    expired). Now it runs on a worker thread. The agent's mapping of this region is held
    (tests/support/hold_mapping: a fault injected at start, no hook in the agent) until
    the test has had Stats answered over gRPC while the registration is unanswered; on
    the event loop, those Stats run out their deadline."""
    size = 8 * MiB
    paths = [str(HOLD_MAPPING), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))  # make test sets none
    monkeypatch.setenv("KVSTORE_FAULT_HOLD_MAP_DIR", str(tmp_path))
    monkeypatch.setenv("KVSTORE_FAULT_HOLD_MAP_BYTES", str(size))
    agent = secure_agent(spawn_agent)
    fd = memfd(size)
    try:
        s, _ = connect(lane_path(agent), timeout=120)
        with s, KVClient(agent.address, token=TOKENS["_cluster"], use_shm=False) as op:
            req = agent_pb2.RegisterShmRequest(size=size).SerializeToString()
            frame = lane.request_frame(lane.REGISTER, lane.encode_meta(B_MD), req)
            socket.send_fds(s, [frame], [fd])
            wait_for(lambda: (tmp_path / "entered").exists(), what="the mapping begun")
            try:
                for _ in range(5):
                    op.stats(timeout=10)
                assert not select.select([s], [], [], 0)[0], "answered while still mapping"
            finally:
                (tmp_path / "release").touch()
            status, body = read_frame(s)
            assert status == lane.OK, body
    finally:
        os.close(fd)


# ------------------------------------------------------------------ F5.1: region-id oracle
def test_another_tenants_region_id_is_answered_as_an_unknown_one(spawn_agent):
    """Before the fix a Get naming another tenant's region was PERMISSION_DENIED ("belongs
    to another tenant") and an unknown id NOT_FOUND: an oracle for live region ids. Now
    both get NOT_FOUND with the same words."""
    agent = secure_agent(spawn_agent)
    path = lane_path(agent)
    fd = memfd(MiB)
    try:
        s, _ = connect(path)
        with (
            s,
            KVClient(agent.address, token=TOKENS["beta"], tenant_secret="b", use_shm=False) as b,
        ):
            status, body = register(s, fd, MiB, A_MD)
            assert status == lane.OK, body
            acmes = region_id(body)
            ns_b = b.open_namespace(SPEC_B)
            ids = b.block_ids(ns_b, prompt_tokens(2, BS))

            def get(rid: int) -> tuple[grpc.StatusCode, str]:
                req = agent_pb2.GetRequest(
                    ns=ns_b.ref,
                    block_ids=ids[0],
                    parent_id=ns_b.root,
                    shm=agent_pb2.ShmTarget(region_id=rid, offsets=[0]),
                )
                try:
                    list(b.stub.Get(req, metadata=B_MD))
                except grpc.RpcError as exc:
                    return exc.code(), exc.details().replace(str(rid), "ID")
                raise AssertionError("served")

            unknown = acmes ^ (1 << 40)
            assert get(acmes) == get(unknown)
            assert get(acmes)[0] == grpc.StatusCode.NOT_FOUND
    finally:
        os.close(fd)


# ------------------------------------------------------------------ F3: lane connections
def _hold(path: str, fd: int, meta, n: int) -> tuple[list[socket.socket], tuple[int, bytes]]:
    """Up to `n` lane connections, each holding a 4 KiB region; and the first refusal."""
    held, refusal = [], (lane.OK, b"")
    for _ in range(n):
        s, (greeting, body) = connect(path)
        if greeting != lane.OK:
            s.close()
            return held, (greeting, body)
        status, body = register(s, fd, 4096, meta)
        if status != lane.OK:
            assert closed(s)
            s.close()
            return held, (status, body)
        held.append(s)
    return held, refusal


def test_one_tenant_cannot_take_every_lane_connection(spawn_agent):
    """Before the fix beta held all local_lane_max_connections (8 here), each kept past
    the idle timeout by a 4 KiB region, and acme's client found the lane full. Now a
    tenant holds at most local_lane_max_connections_per_tenant (2 here); its next
    connection is refused at its first frame (FAILED_PRECONDITION: clients, old ones
    too, go on over gRPC), and acme's client gets the lane."""
    agent = secure_agent(
        spawn_agent, local_lane_max_connections=8, local_lane_max_connections_per_tenant=2
    )
    path = lane_path(agent)
    fd = memfd(4096)
    held: list[socket.socket] = []
    try:
        held, (status, body) = _hold(path, fd, B_MD, 8)
        assert len(held) == 2, (len(held), body)
        assert status == code(OLD_CLIENTS_FALL_BACK_ON), body
        assert b"local_lane_max_connections_per_tenant" in body, body
        with KVClient(agent.address, token=TOKENS["acme"], tenant_secret="a") as a:
            assert a.uses_local_lane
            ns = a.open_namespace(SPEC_A)
            ids, blocks = a.block_ids(ns, prompt_tokens(5, 2 * BS)), blocks_for(5, 2)
            assert a.put(ns, ids, blocks).stored == 2
            assert all(torch.equal(x, y) for x, y in zip(a.get(ns, ids), blocks))
        # beta's own client past its share is refused the lane and works over gRPC.
        with KVClient(agent.address, token=TOKENS["beta"], tenant_secret="b") as b:
            assert not b.uses_shm
            ns = b.open_namespace(SPEC_B)
            ids, blocks = b.block_ids(ns, prompt_tokens(5, BS)), blocks_for(5, 1)
            assert b.put(ns, ids, blocks).stored == 1
        assert counters(agent)["local_lane_refused_tenant_full"] == 2
    finally:
        for s in held:
            s.close()
        os.close(fd)


def test_a_lone_tenant_keeps_the_lane_it_had_before_the_caps(spawn_agent):
    """The chart's engines share one tenant. With the per-tenant cap at a quarter of 64
    connections such a deployment dropped from 64 lane connections per agent to 16. Now
    the default lane has 80 and a tenant may hold all but a fifth: 64, as before, and
    the 16 left are the other tenants' (the 65th of acme's is refused, beta's served)."""
    agent = secure_agent(spawn_agent)
    path = lane_path(agent)
    fd = memfd(4096)
    held: list[socket.socket] = []
    try:
        held, (status, body) = _hold(path, fd, A_MD, 65)
        assert len(held) == 64, (len(held), body)
        assert status == code(OLD_CLIENTS_FALL_BACK_ON), body
        assert b"local_lane_max_connections_per_tenant" in body, body
        other, _ = connect(path)
        with other:
            assert register(other, fd, 4096, B_MD)[0] == lane.OK
    finally:
        for s in held:
            s.close()
        os.close(fd)


def test_staging_larger_than_the_agent_takes_goes_over_grpc(spawn_agent):
    """A client whose staging is over local_lane_max_region_bytes (the probe's 2 GiB
    against the 1 GiB default; 8 MiB against 4 MiB here) was refused INVALID_ARGUMENT,
    which KVClient() re-raised: the connector marked the agent down, no caching at all.
    Now it is FAILED_PRECONDITION and the client carries payloads over gRPC."""
    agent = secure_agent(spawn_agent, local_lane_max_region_bytes="4MiB")
    with KVClient(agent.address, token=TOKENS["acme"], tenant_secret="a", shm_bytes=8 * MiB) as a:
        assert not a.uses_shm
        ns = a.open_namespace(SPEC_A)
        ids, blocks = a.block_ids(ns, prompt_tokens(8, 2 * BS)), blocks_for(8, 2)
        assert a.put(ns, ids, blocks).stored == 2
        assert all(torch.equal(x, y) for x, y in zip(a.get(ns, ids), blocks))


@pytest.mark.parametrize("cap", ["region", "connections"])
def test_a_refused_registration_again_goes_over_grpc(spawn_agent, cap):
    """A client registers again once its lane connection is gone (the region idle close,
    an agent restart). Before the fix a refusal by a cap then (here the agent came back
    with a region cap under the client's staging, or with the tenant's one connection
    taken) failed that call and every later one: the client kept trying. Now it gives
    its staging up and carries on over gRPC."""
    agent = secure_agent(spawn_agent)
    fd = memfd(4096)
    with (
        KVClient(agent.address, token=TOKENS["acme"], tenant_secret="a", shm_bytes=8 * MiB) as a,
        contextlib.ExitStack() as held,
    ):
        assert a.uses_local_lane
        ns = a.open_namespace(SPEC_A)
        ids, blocks = a.block_ids(ns, prompt_tokens(9, 2 * BS)), blocks_for(9, 2)
        assert a.put(ns, ids, blocks).stored == 2
        if cap == "region":
            agent.config["local_lane_max_region_bytes"] = "4MiB"
            agent.restart()
        else:
            agent.config["local_lane_max_connections_per_tenant"] = 1
            agent.restart()
            s = held.enter_context(connect(lane_path(agent))[0])
            assert register(s, fd, 4096, A_MD)[0] == lane.OK  # acme's one connection
        more, more_blocks = a.block_ids(ns, prompt_tokens(10, 2 * BS)), blocks_for(10, 2)
        assert a.put(ns, more, more_blocks).stored == 2
        assert not a.uses_shm and not a.uses_local_lane
        assert all(torch.equal(x, y) for x, y in zip(a.get(ns, more), more_blocks))
        assert a.lookup(ns, more).matched == 2
        for _ in range(2):  # later calls too, with no registration tried again
            assert a.put(ns, more, more_blocks).already_present == 2
    os.close(fd)


def test_the_connector_loads_over_grpc_when_its_staging_is_refused(spawn_agent):
    """The vLLM connector's link (kvstore.integrations.vllm_agent, without vLLM): before
    the fix a staging area over the agent's region cap made KVClient() raise, and the
    link marked the agent down (nothing saved or loaded). Now the client goes without
    shared memory and the link saves and loads over gRPC."""
    agent = secure_agent(spawn_agent, local_lane_max_region_bytes="4MiB")
    settings = ConnectorSettings.from_extra(
        {
            "agent": agent.address,
            "tenant": "acme",
            "token": TOKENS["acme"],
            "tenant_secret": "a",
            "shm_mib": 8,
        }
    )
    link = AgentLink(settings, SPEC_A, "test", retry_s=0.01)
    try:
        data = torch.stack(blocks_for(11, 3))
        ids, matched = link.prefix(prompt_tokens(11, 3 * BS + 1), 3, None)
        assert len(ids) == 3 and matched == 0
        assert link.save(ids, None, None, data) == 3
        got: list[torch.Tensor] = []
        assert link.load(ids, None, None, lambda first, b: got.append(b.clone())) == 3
        assert torch.equal(torch.cat(got).view(torch.uint8), data.view(torch.uint8))
    finally:
        link.close()


def test_connections_that_never_authenticate_make_room_for_one_that_does(spawn_agent):
    """A connection's tenant is known at its first frame only, so silent connections
    could fill the lane past every tenant's share (renewed before each idle timeout).
    Now at the cap a new connection takes the place of the oldest that has sent no
    frame yet: acme's client gets the lane beside 4 silent ones."""
    agent = secure_agent(spawn_agent, local_lane_max_connections=4)
    path = lane_path(agent)
    silent = [connect(path) for _ in range(4)]
    try:
        assert all(greeting[0] == lane.OK for _, greeting in silent)
        with KVClient(agent.address, token=TOKENS["acme"], tenant_secret="a") as a:
            assert a.uses_local_lane
            ns = a.open_namespace(SPEC_A)
            ids, blocks = a.block_ids(ns, prompt_tokens(6, BS)), blocks_for(6, 1)
            assert a.put(ns, ids, blocks).stored == 1
        assert closed(silent[0][0])  # the oldest silent one made room
        assert counters(agent)["local_lane_shed_unauthenticated"] >= 1
    finally:
        for s, _ in silent:
            s.close()


def test_an_idle_connection_holding_a_region_is_closed_and_the_client_carries_on(spawn_agent):
    """Before the fix a connection holding a region was never closed for idling, so
    regions kept lane slots forever. Now it is closed after
    local_lane_region_idle_timeout_s without a frame; the client, whose next call finds
    the connection gone, registers again and the call succeeds, on the lane."""
    agent = secure_agent(
        spawn_agent, local_lane_idle_timeout_s=0.5, local_lane_region_idle_timeout_s=2.0
    )
    with KVClient(agent.address, token=TOKENS["acme"], tenant_secret="a") as a:
        assert a.uses_local_lane
        ns = a.open_namespace(SPEC_A)
        ids, blocks = a.block_ids(ns, prompt_tokens(7, 2 * BS)), blocks_for(7, 2)
        assert a.put(ns, ids, blocks).stored == 2
        wait_for(lambda: counters(agent)["local_lane_idle_closed"] >= 1, what="idle close")
        lane_calls_before_get = counters(agent)["local_lane_calls"]
        assert all(torch.equal(x, y) for x, y in zip(a.get(ns, ids), blocks))
        # At least once: on a loaded host the connection may idle out again before
        # the Get; either way the Get was served and the client is back on the lane.
        assert a.reregistrations >= 1 and a.uses_local_lane
        assert counters(agent)["local_lane_calls"] > lane_calls_before_get
