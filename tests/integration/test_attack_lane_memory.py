"""Attacks on the local lane's shared-memory registration and its connection slots, each
against a real agent process and real memfds (docs/security.md, "The local lane"):

- another tenant's region id answered differently from an unknown one: now both are
  the one unknown-region answer."""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import socket

import grpc
import torch
from support.common import make_namespace, prompt_tokens, wait_for
from support.lane_raw import closed, connect, read_frame

from kvstore import lane
from kvstore.client import KVClient
from kvstore.client.convert import block_shape, torch_dtype
from kvstore.v1 import agent_pb2

SPEC_A = make_namespace(tenant="acme", name="chat")
SPEC_B = make_namespace(tenant="beta", name="chat")
BS = SPEC_A.block_size
TOKENS = {"acme": "acme-token", "beta": "beta-token", "_cluster": "cluster-token"}
A_MD = (("authorization", "Bearer " + TOKENS["acme"]),)
B_MD = (("authorization", "Bearer " + TOKENS["beta"]),)
MiB = 1 << 20


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


def rss_shmem(pid: int) -> int:
    """Shared memory resident in process `pid` (what mapping a memfd populated adds)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no RssShmem")


def counters(agent) -> dict:
    with KVClient(agent.address, token=TOKENS["_cluster"], use_shm=False) as op:
        return dict(op.stats().counters)


def blocks_for(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape, dtype = block_shape(SPEC_A), torch_dtype(SPEC_A.kv_dtype)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(n)]


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
