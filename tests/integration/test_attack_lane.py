"""Attacks on the same-host path (issue #18 items 1 and 5), each against real agent
processes on this host: shared memory can only be registered by handing over memory the
caller holds (a sealed memfd, over the local lane), on every agent of the host; the lane
socket is the agent's user's only, checks peer credentials, authenticates a frame before
reading its message, caps connections and closes idle ones."""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import resource
import socket
import stat
import time
from multiprocessing import shared_memory

import grpc
import pytest
import torch
from support.common import make_namespace, proc_status_bytes, prompt_tokens, wait_for
from support.lane_raw import closed, connect, raw_call, read_frame

from kvstore import lane
from kvstore.client import KVClient
from kvstore.client.convert import block_shape, torch_dtype
from kvstore.v1 import agent_pb2, agent_pb2_grpc

SPEC_A = make_namespace(tenant="acme", name="chat")
SPEC_B = make_namespace(tenant="beta", name="chat")
BS = SPEC_A.block_size
TOKENS = {"acme": "acme-token", "beta": "beta-token", "_cluster": "cluster-token"}
A_MD = (("authorization", "Bearer " + TOKENS["acme"]),)
B_MD = (("authorization", "Bearer " + TOKENS["beta"]),)
P, IA = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT


def tenants() -> dict:
    return {
        t: {"token_sha256": hashlib.sha256(tok.encode()).hexdigest()} for t, tok in TOKENS.items()
    }


def secure_agent(spawn_agent, **cfg):
    return spawn_agent(allow_unauthenticated=False, tenants=tenants(), **cfg)


def blocks_for(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape, dtype = block_shape(SPEC_A), torch_dtype(SPEC_A.kv_dtype)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(n)]


def lane_path(agent) -> str:
    return re.findall(r"local lane on (\S+)", agent.log)[-1]


def status_of(fn, *args, **kw) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as ei:
        fn(*args, **kw)
    return ei.value.code(), ei.value.details()


def sealed_memfd(size: int, seal: bool = True) -> int:
    fd = os.memfd_create("attack", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    os.posix_fallocate(fd, 0, size)  # allocated, as a client's staging is
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd


def register_frame(size: int, meta=B_MD) -> bytes:
    req = agent_pb2.RegisterShmRequest(size=size).SerializeToString()
    return lane.request_frame(lane.REGISTER, lane.encode_meta(meta), req)


def lane_counters(agent) -> dict:
    """The node-wide Stats counters (what an operator, the cluster identity, reads)."""
    with KVClient(agent.address, token=TOKENS["_cluster"], use_shm=False) as op:
        return dict(op.stats().counters)


def code(sc: grpc.StatusCode) -> int:
    return sc.value[0]


def own_shm_files() -> list[str]:
    """Files under /dev/shm named as this process's staging once was (others share it)."""
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"kvstore-{os.getpid()}-")]


# ------------------------------------------------------------------ item 1: shared memory
def test_no_tenant_can_register_memory_by_name_on_any_agent_of_the_host(spawn_agent):
    """The issue's attack: A's staging region on agent-0; B names it on agent-1 (same
    host), Puts from it and Gets into it. Now A's staging has no name at all, and naming
    any file (a kvstore-looking region, an arbitrary file, '.', '..', the lane socket) is
    refused with PERMISSION_DENIED on every agent; A's zero-copy views keep A's bytes."""
    agent0, agent1 = secure_agent(spawn_agent), secure_agent(spawn_agent)
    legacy = shared_memory.SharedMemory(create=True, size=1 << 20)  # a named region
    try:
        with KVClient(agent0.address, token=TOKENS["acme"], tenant_secret="a") as a:
            assert a.uses_shm and a.uses_local_lane
            assert own_shm_files() == []  # A's staging has no name under /dev/shm
            ns = a.open_namespace(SPEC_A)
            ids, blocks = a.block_ids(ns, prompt_tokens(1, 4 * BS)), blocks_for(1, 4)
            a.put(ns, ids, blocks)
            views = a.get_views(ns, ids)
            names = [legacy.name, ".", "..", os.path.basename(lane_path(agent0)), "nope"]
            for agent in (agent0, agent1):
                with grpc.insecure_channel(agent.address) as ch:
                    stub = agent_pb2_grpc.NodeAgentStub(ch)
                    for name in names:
                        req = agent_pb2.RegisterShmRequest(name=name, size=1 << 20)
                        got = status_of(stub.RegisterShm, req, metadata=B_MD)
                        assert got[0] == P and "file descriptor" in got[1], (name, got)
            assert all(torch.equal(v, b) for v, b in zip(views, blocks))
            assert all(torch.equal(x, y) for x, y in zip(a.get(ns, ids), blocks))
    finally:
        legacy.close()
        legacy.unlink()


def test_the_lane_maps_only_sealed_memory_the_caller_hands_over(spawn_agent):
    """Over the lane, RegisterShm takes one descriptor of a memfd sealed against shrinking:
    a /dev/shm file's descriptor, a directory, an unsealed or short memfd, no descriptor,
    or a descriptor on another method are INVALID_ARGUMENT; a proper one works, for its
    tenant only, and dies with its connection."""
    agent = secure_agent(spawn_agent)
    path = lane_path(agent)
    legacy = shared_memory.SharedMemory(create=True, size=1 << 20)
    fds = {
        "a /dev/shm file": os.open(f"/dev/shm/{legacy.name}", os.O_RDWR),
        "a directory": os.open("/dev/shm", os.O_RDONLY),
        "an unsealed memfd": sealed_memfd(1 << 20, seal=False),
        "a short memfd": sealed_memfd(1 << 16),
    }
    try:
        for what, fd in fds.items():
            status, body = raw_call(path, register_frame(1 << 20), [fd])
            assert status == code(IA), (what, body)
        status, body = raw_call(path, register_frame(1 << 20))
        assert status == code(IA) and b"exactly one file descriptor" in body
        lookup = lane.request_frame(lane.LOOKUP, lane.encode_meta(B_MD), b"")
        status, body = raw_call(path, lookup, [fds["a short memfd"]])
        assert status == code(IA) and b"only RegisterShm" in body
        # B's own sealed memfd: registered, usable by B over gRPC, not by A.
        mine = sealed_memfd(1 << 20)
        s, (greeting, _) = connect(path)
        with (
            s,
            KVClient(agent.address, token=TOKENS["beta"], tenant_secret="b", use_shm=False) as b,
            KVClient(agent.address, token=TOKENS["acme"], tenant_secret="a", use_shm=False) as a,
        ):
            assert greeting == lane.OK
            socket.send_fds(s, [register_frame(1 << 20)], [mine])
            status, body = read_frame(s)
            assert status == lane.OK, body
            rid = agent_pb2.RegisterShmResponse.FromString(body).region_id
            ns_b = b.open_namespace(SPEC_B)
            ids = b.block_ids(ns_b, prompt_tokens(2, BS))
            get = agent_pb2.GetRequest(
                ns=ns_b.ref,
                block_ids=ids[0],
                parent_id=ns_b.root,
                shm=agent_pb2.ShmTarget(region_id=rid, offsets=[0]),
            )
            assert [r.count for r in b.stub.Get(get, metadata=B_MD)] == [0]  # a miss, served
            assert status_of(lambda: list(a.stub.Get(get, metadata=A_MD)))[0] == P
            s.close()  # the region goes with its connection
            wait_for(
                lambda: (
                    status_of(lambda: list(b.stub.Get(get, metadata=B_MD)))[0]
                    == grpc.StatusCode.NOT_FOUND
                ),
                what="region dropped with its connection",
            )
        os.close(mine)
    finally:
        for fd in fds.values():
            os.close(fd)
        legacy.close()
        legacy.unlink()


# ------------------------------------------------------------------- item 5: lane limits


def test_socket_is_owner_only_and_peers_are_checked(spawn_agent):
    agent = secure_agent(spawn_agent)
    path = lane_path(agent)
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
    # An operator opens the mode up by mistake: the peer check still turns away other users.
    os.chmod(path, 0o666)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: another user on the host
        try:
            os.setgid(65534)
            os.setuid(65534)
            s, (status, body) = connect(path)
            os.write(w, bytes([status]) + body[:200])
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    got = os.read(r, 512)
    os.close(r)
    assert got[0] == code(P) and b"uid 65534" in got[1:], got
    assert lane_counters(agent)["local_lane_refused_peer"] == 1


def test_group_setting_opens_the_socket_to_that_group(spawn_agent):
    agent = secure_agent(spawn_agent, local_lane_group=str(os.getgid()))
    st = os.stat(lane_path(agent))
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == os.getgid()


def test_unauthenticated_frames_are_refused_before_their_body_is_read(spawn_agent):
    """8 connections each declaring the largest frame and sending all of it but the last
    byte, without a token: each is answered UNAUTHENTICATED after its header and
    metadata, and the agent's memory does not grow by what they sent."""
    agent = secure_agent(spawn_agent)
    path = lane_path(agent)
    n = lane.MAX_FRAME_BYTES
    chunk = bytes(1 << 20)
    rss0 = proc_status_bytes(agent.proc.pid, "VmRSS")
    socks = []
    for _ in range(8):
        s, (greeting, _) = connect(path, timeout=60)
        assert greeting == lane.OK
        socks.append(s)
        try:
            s.sendall(lane.REQUEST_HEADER.pack(n, lane.LOOKUP, 0))
            for _ in range((n - 1) // len(chunk)):
                s.sendall(chunk)
            s.sendall(bytes((n - 1) % len(chunk)))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the agent hung up on us mid-body: what it should do
    grown = proc_status_bytes(agent.proc.pid, "VmRSS") - rss0
    for s in socks:
        status, body = read_frame(s)
        assert status == code(grpc.StatusCode.UNAUTHENTICATED), body
        assert closed(s)
        s.close()
    assert grown < 32 << 20, f"agent RSS grew by {grown >> 20} MiB"
    # A header declaring 64 MiB (the old limit) is refused on its own.
    s, _ = connect(path)
    with s:
        s.sendall(lane.REQUEST_HEADER.pack(64 << 20, lane.LOOKUP, 0))
        status, body = read_frame(s)
        assert status == code(IA) and b"limit" in body
    assert lane_counters(agent)["local_lane_refused_frames"] == 9


def test_connections_beyond_the_cap_are_refused(spawn_agent):
    """At the cap, with every connection past its first frame (a silent one would make
    room: tests/integration/test_attack_lane_memory.py), a new connection is refused."""
    agent = secure_agent(
        spawn_agent, local_lane_max_connections=3, local_lane_max_connections_per_tenant=3
    )
    path = lane_path(agent)
    held = [connect(path) for _ in range(3)]
    assert all(greeting[0] == lane.OK for _, greeting in held)
    lookup = lane.request_frame(lane.LOOKUP, lane.encode_meta(B_MD), b"")
    for s, _ in held:  # each authenticated: its tenant known, it holds its slot
        s.sendall(lookup)
        read_frame(s)
    s, (status, body) = connect(path)
    with s:
        assert status == code(grpc.StatusCode.RESOURCE_EXHAUSTED) and b"limit of 3" in body
        assert closed(s)
    # A client that finds the lane full still works, over gRPC.
    with KVClient(agent.address, token=TOKENS["acme"], tenant_secret="a") as c:
        assert not c.uses_shm
        ns = c.open_namespace(SPEC_A)
        ids, blocks = c.block_ids(ns, prompt_tokens(3, 2 * BS)), blocks_for(3, 2)
        assert c.put(ns, ids, blocks).stored == 2
    # Ours, and any other agent's stale-socket probe (remove_stale_sockets) meanwhile.
    assert lane_counters(agent)["local_lane_refused_full"] >= 2
    held[0][0].close()
    wait_for(lambda: connect(path)[1][0] == lane.OK, what="a slot freed")
    for h, _ in held[1:]:
        h.close()


def test_idle_and_stalled_connections_are_closed(spawn_agent):
    agent = secure_agent(spawn_agent, local_lane_idle_timeout_s=1.0)
    path = lane_path(agent)
    with KVClient(agent.address, token=TOKENS["acme"], tenant_secret="a") as c:
        assert c.uses_local_lane
        ns = c.open_namespace(SPEC_A)
        ids, blocks = c.block_ids(ns, prompt_tokens(4, 2 * BS)), blocks_for(4, 2)
        c.put(ns, ids, blocks)
        meta = lane.encode_meta(A_MD)
        stalls = [
            b"",  # connects and says nothing
            lane.REQUEST_HEADER.pack(100, lane.LOOKUP, 0)[:3],  # half a header
            lane.REQUEST_HEADER.pack(len(meta) + 100, lane.LOOKUP, len(meta)) + meta,  # no body
        ]
        for stall in stalls:
            s, (greeting, _) = connect(path, timeout=60)
            with s:
                assert greeting == lane.OK
                s.sendall(stall)
                assert s.recv(1) == b"", stall  # the agent hangs up (within the timeout)
        time.sleep(2.5)  # longer than the idle timeout: a client holding a region stays
        assert all(torch.equal(x, y) for x, y in zip(c.get(ns, ids), blocks))
        assert c.reregistrations == 0 and c.uses_local_lane
    assert lane_counters(agent)["local_lane_idle_closed"] == 3


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_descriptors_sent_along_are_not_held_past_two(spawn_agent):
    """Before its token was checked, one connection sending a frame's metadata a byte at a
    time with two descriptors on each byte made the agent hold every one of them: 20,000
    in 1.6 s, its limit, and then neither gRPC nor the lane could accept a connection.
    Now the agent holds two for the frame and closes the rest as they arrive."""
    agent = secure_agent(spawn_agent)
    path, pid = lane_path(agent), agent.proc.pid
    before = open_fds(pid)
    s, (greeting, _) = connect(path, timeout=60)
    assert greeting == lane.OK
    meta = lane.MAX_META_BYTES
    s.sendall(lane.REQUEST_HEADER.pack(meta + 10, lane.LOOKUP, meta))
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        for _ in range(2000):
            socket.send_fds(s, [b"x"], [null, null])
    finally:
        os.close(null)

    def settled() -> bool:  # every descriptor read (closed, or held: the old agent)
        closed = lane_counters(agent).get("local_lane_fds_closed", 0)
        return closed >= 2 * 2000 - 2 or open_fds(pid) > before + 2000

    wait_for(settled, 30, what="the agent to read what was sent")
    assert open_fds(pid) <= before + 4, (before, open_fds(pid))  # its socket, two held
    s.close()
    with KVClient(agent.address, token=TOKENS["beta"], tenant_secret="b") as c:
        assert c.uses_local_lane  # another tenant still gets the lane


def test_the_lane_accepts_again_once_the_agent_has_descriptors_again(spawn_agent):
    """An accept that failed for want of descriptors (EMFILE) ended the lane's accept
    loop, unlogged: the lane stayed dead until the agent restarted. Here the agent's own
    limit is lowered to what it holds, a connection is refused by the kernel's accept,
    then the limit is raised again: the lane greets the next one."""
    agent = secure_agent(spawn_agent)
    path, pid = lane_path(agent), agent.proc.pid
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (open_fds(pid), hard))
    try:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(2)
        s.connect(path)  # queued by the kernel; the agent's accept fails
        # (no Stats meanwhile: the agent's gRPC port cannot accept either)
        wait_for(lambda: "local lane: accept failed" in agent.log, 30, what="EMFILE")
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
    s.settimeout(30)
    assert read_frame(s)[0] == lane.OK  # the same connection, accepted on the retry
    s.close()
    t, (greeting, _) = connect(path)
    with t:
        assert greeting == lane.OK
    assert lane_counters(agent)["local_lane_accept_failed"] >= 1
