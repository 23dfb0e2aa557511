"""Memory an agent's gRPC port holds for callers, against real agent processes
(docs/security.md, "Memory before authentication"): a caller without a valid token gets
UNAUTHENTICATED without its message being received, so it cannot make the agent buffer
megabytes per call; a tenant's messages are capped at a few MiB (max_message_bytes, 8 MiB
by default), which the client's own Put messages fit whatever the block size."""

from __future__ import annotations

import threading

import grpc
import torch
from support.attack import TOKENS, tenants
from support.common import make_namespace, proc_status_bytes, prompt_tokens

from kvstore.client import KVClient
from kvstore.client.convert import block_shape, torch_dtype
from kvstore.config import MiB
from kvstore.tls import channel
from kvstore.v1 import agent_pb2, agent_pb2_grpc

CALLS = 32
MESSAGE = 7 * MiB  # under the agent's max_message_bytes (8 MiB): gRPC would take it


def _lookups(address: str, metadata: tuple) -> list[grpc.StatusCode]:
    """CALLS concurrent Lookups of MESSAGE bytes each, one channel per call."""
    blob = bytes(MESSAGE)
    codes: list[grpc.StatusCode] = []
    start = threading.Barrier(CALLS)

    def one() -> None:
        ch = channel(address, None, [("grpc.max_send_message_length", 16 * MiB)])
        try:
            stub = agent_pb2_grpc.NodeAgentStub(ch)
            req = agent_pb2.LookupRequest(
                ns=agent_pb2.NamespaceRef(namespace_id=b"x" * 16), block_ids=blob
            )
            start.wait()
            try:
                stub.Lookup(req, metadata=metadata, timeout=120)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())
        finally:
            ch.close()

    threads = [threading.Thread(target=one) for _ in range(CALLS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return codes


def test_unauthenticated_calls_are_refused_before_their_message_is_received(spawn_agent):
    agent = spawn_agent(allow_unauthenticated=False, tenants=tenants())
    pid = agent.proc.pid
    before = proc_status_bytes(pid, "VmHWM") // MiB
    for md in ((), (("authorization", "Bearer not-a-token"),)):
        codes = _lookups(agent.address, md)
        assert set(codes) == {grpc.StatusCode.UNAUTHENTICATED}, codes
    # 64 calls of 7 MiB: received whole before the refusal (as before), the agent's peak
    # grew by hundreds of MiB (224 MiB of messages per round, deserialized copies on
    # top); refused unread, each call holds at most its stream's flow-control window.
    grown = proc_status_bytes(pid, "VmHWM") // MiB - before
    # Received, each round's messages would be CALLS x MESSAGE (224 MiB; the code before
    # grew 238). Refused from their headers, each call costs at most its flow-control
    # window: 57-101 MiB measured here for both rounds, up to 119 beside a full make test.
    assert grown < CALLS * MESSAGE * 3 // 4 // MiB, f"the peak RSS grew {grown} MiB"
    # A tenant's call is still received and answered on its merits.
    codes = _lookups(agent.address, (("authorization", f"Bearer {TOKENS['acme']}"),))
    assert set(codes) == {grpc.StatusCode.PERMISSION_DENIED}, codes


BIG = make_namespace(num_layers=16, num_kv_heads=8, head_dim=128)  # 1 MiB blocks


def test_grpc_put_of_large_blocks_fits_the_agents_message_limit(spawn_agent):
    assert BIG.block_bytes == MiB
    # The least max_message_bytes the agent accepts for 1 MiB slots: 4 MiB of payload
    # (what the client puts in one message) plus headroom. The client used to send 8
    # blocks per Put message whatever their size (8 MiB here), which it refused.
    agent = spawn_agent(
        slot_bytes="1MiB", pool_bytes="32MiB", max_message_bytes=4 * MiB + 64 * 1024
    )
    g = torch.Generator().manual_seed(3)
    blocks = [
        torch.randn(block_shape(BIG), generator=g).to(torch_dtype(BIG.kv_dtype)) for _ in range(8)
    ]
    with KVClient(agent.address, use_shm=False, tenant_secret=b"s") as c:
        ns = c.open_namespace(BIG)
        ids = c.block_ids(ns, prompt_tokens(1, 8 * BIG.block_size))
        r = c.put(ns, ids, blocks)
        assert (r.stored, r.already_present) == (8, 0), r
        got = c.get(ns, ids)  # the agent's Get responses fit the same limit
        assert len(got) == 8 and all(torch.equal(a, b) for a, b in zip(got, blocks))
