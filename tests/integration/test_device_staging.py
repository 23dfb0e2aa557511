"""Device staging (kvstore/cuda_vmm.py, node_agent/shm.py DeviceRegion): a GPU client lends
its agent staging memory on its GPU and Gets land there, copied from the agent's GPU pool
device to device. What runs without a GPU: the agent's refusals (a host-memory pool, a bad
request) over its real local lane, each answered with a precise status on a connection
that goes on serving, and a client that cannot attach keeps host staging. The GPU paths
themselves are in tests/gpu/test_cuda.py."""

from __future__ import annotations

import fcntl
import os
import socket

import grpc
import pytest
import torch
from support.common import TEST_SECRET, make_namespace, prompt_tokens
from support.lane_raw import connect, read_frame

from kvstore import lane
from kvstore.client import KVClient
from kvstore.client.convert import block_shape, torch_dtype
from kvstore.v1 import agent_pb2, agent_pb2_grpc

SPEC = make_namespace(name="device-staging")


def memfd(size: int) -> int:
    fd = os.memfd_create("test-device", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    os.posix_fallocate(fd, 0, size)  # allocated, as a client's staging is
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd


def register(s: socket.socket, req: agent_pb2.RegisterShmRequest, fd: int) -> tuple[int, bytes]:
    frame = lane.request_frame(lane.REGISTER, b"", req.SerializeToString())
    socket.send_fds(s, [frame], [fd])
    return read_frame(s)


def test_an_agent_with_a_host_pool_refuses_device_staging_and_serves_on(spawn_agent):
    agent = spawn_agent()
    ch = grpc.insecure_channel(agent.address)
    where = agent_pb2_grpc.NodeAgentStub(ch).LocalLane(agent_pb2.LocalLaneRequest())
    fd = memfd(1 << 20)
    try:
        s, (status, _) = connect(where.socket)
        with s:
            assert status == lane.OK
            uuid = bytes(range(16))
            status, body = register(
                s, agent_pb2.RegisterShmRequest(size=1 << 20, device_uuid=uuid), fd
            )
            assert status == grpc.StatusCode.FAILED_PRECONDITION.value[0]
            assert "pool is in host memory (cpu)" in body.decode()
            assert "use host staging" in body.decode()
            status, body = register(
                s, agent_pb2.RegisterShmRequest(size=1 << 20, device_uuid=b"short"), fd
            )
            assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert "16 bytes" in body.decode()
            # The connection was not dropped, and nothing was mapped: a host region next.
            status, body = register(s, agent_pb2.RegisterShmRequest(size=1 << 20), fd)
            assert status == lane.OK, body
            assert agent_pb2.RegisterShmResponse.FromString(body).region_id
    finally:
        os.close(fd)
        ch.close()


@pytest.mark.parametrize(
    "device,why",
    [("cpu", "lives on a CUDA device, not cpu"), ("cuda:0", "CUDA is not available")],
)
def test_a_client_that_cannot_attach_device_staging_keeps_host_staging(spawn_agent, device, why):
    if torch.cuda.is_available() and device != "cpu":
        pytest.skip("a GPU is here: tests/gpu/test_cuda.py attaches for real")
    agent = spawn_agent()
    with KVClient(agent.address, tenant_secret=TEST_SECRET) as c:
        assert c.uses_local_lane
        assert why in c.attach_device_staging(device, 1 << 20)
        assert not c.uses_device_staging
        ns = c.open_namespace(SPEC)
        assert c.device_staging_capacity(ns) == 0
        with pytest.raises(RuntimeError, match="attach_device_staging first"):
            c.get_device_staged_tensor(ns, [])
        ids = c.block_ids(ns, prompt_tokens(5, 3 * SPEC.block_size))
        g = torch.Generator().manual_seed(5)
        blocks = [
            torch.randn(block_shape(SPEC), generator=g).to(torch_dtype(SPEC.kv_dtype))
            for _ in range(3)
        ]
        assert c.put(ns, ids, blocks).stored == 3
        got = c.get_staged_tensor(ns, ids)
        assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, blocks))


def test_a_client_without_a_local_lane_does_not_attach(spawn_agent):
    agent = spawn_agent()
    with KVClient(agent.address, tenant_secret=TEST_SECRET, local_lane=False) as c:
        assert "no local lane" in c.attach_device_staging("cuda:0", 1 << 20)
