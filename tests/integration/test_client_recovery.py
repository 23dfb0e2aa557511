"""A same-host client outlives its agent's restart (it registers its shared-memory region
and the local lane again and retries, transparently), and no client call hangs on a
frozen agent: each has a deadline and fails with the client's DeadlineExceeded. Real
agent processes, restarted on the same port or stopped with SIGSTOP."""

from __future__ import annotations

import os
import signal
import threading

import grpc
import pytest
import torch
from support.common import TEST_SECRET, make_namespace, prompt_tokens

from kvstore.client import DeadlineExceeded, KVClient, KVClientError
from kvstore.client.convert import block_shape, torch_dtype

SPEC = make_namespace()
BS = SPEC.block_size


def blocks_for(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(block_shape(SPEC), generator=g).to(torch_dtype(SPEC.kv_dtype)) for _ in range(n)
    ]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_same_host_clients_register_again_after_an_agent_restart(spawn_agent):
    agent = spawn_agent(default_policy={"persist": True})  # blocks outlive the restart
    grpc_shm = KVClient(
        agent.address, tenant_secret=TEST_SECRET, shm_bytes=1 << 20, local_lane=False
    )
    lane_c = KVClient(agent.address, tenant_secret=TEST_SECRET, shm_bytes=1 << 20)
    try:
        assert grpc_shm.uses_shm and not grpc_shm.uses_local_lane and lane_c.uses_local_lane
        handles = {c: c.open_namespace(SPEC) for c in (grpc_shm, lane_c)}
        ns = handles[grpc_shm]
        ids_a = grpc_shm.block_ids(ns, prompt_tokens(1, 3 * BS))
        ids_b = grpc_shm.block_ids(ns, prompt_tokens(2, 3 * BS))
        # A then B: each client's staging area now holds B's bytes, not A's.
        for c in (grpc_shm, lane_c):
            c.put(handles[c], ids_a, blocks_for(1, 3))
            c.put(handles[c], ids_b, blocks_for(2, 3))
        agent.restart()
        # A newcomer registers first with the new process. Its region must not be
        # mistaken for the old clients' (ids counted from 1 would give it theirs).
        with KVClient(agent.address, tenant_secret=TEST_SECRET, shm_bytes=1 << 20) as new:
            new_ns = new.open_namespace(SPEC)
            assert same(new.get(new_ns, ids_b), blocks_for(2, 3))
            for c in (grpc_shm, lane_c):
                # Get, Put and Lookup just work: the client registered again, once.
                assert same(c.get(handles[c], ids_a), blocks_for(1, 3)), c.uses_local_lane
                ids_c = c.block_ids(handles[c], prompt_tokens(3 + c.uses_local_lane, 2 * BS))
                assert c.put(handles[c], ids_c, blocks_for(3, 2)).stored == 2
                assert c.lookup(handles[c], ids_c).matched == 2
                assert c.reregistrations == 1
            assert lane_c.uses_local_lane and not grpc_shm.uses_local_lane
            # The newcomer's staging area was never written by the old clients' calls.
            assert same(new.get_views(new_ns, ids_b), blocks_for(2, 3))
    finally:
        grpc_shm.close()
        lane_c.close()


def _in_thread(fn):
    """Run fn in a thread; (finished, exception). A hang shows as finished=False."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)  # far beyond any deadline below: only a hang gets here
    return not t.is_alive(), out.get("error")


def test_a_frozen_agent_gives_deadline_exceeded_not_a_hang(spawn_agent):
    agent = spawn_agent()
    lane_c = KVClient(agent.address, tenant_secret=TEST_SECRET, shm_bytes=1 << 20, timeout=1.0)
    plain = KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False, timeout=1.0)
    try:
        assert lane_c.uses_local_lane
        ns = {c: c.open_namespace(SPEC) for c in (lane_c, plain)}
        ids = lane_c.block_ids(ns[lane_c], prompt_tokens(5, 2 * BS))
        lane_c.put(ns[lane_c], ids, blocks_for(5, 2))
        os.kill(agent.proc.pid, signal.SIGSTOP)
        try:
            calls = [
                lambda: lane_c.lookup(ns[lane_c], ids),  # the lane
                lambda: lane_c.get(ns[lane_c], ids),  # registering again, gRPC
                lambda: plain.lookup(ns[plain], ids),
                lambda: plain.get(ns[plain], ids),
                lambda: plain.put(ns[plain], ids, blocks_for(5, 2)),
                lambda: plain.stats(),
                lambda: plain.lookup(ns[plain], ids, timeout=0.2),  # per call
                lambda: KVClient(agent.address, use_shm=False, timeout=0.5).open_namespace(SPEC),
            ]
            for i, call in enumerate(calls):
                finished, err = _in_thread(call)
                assert finished, f"call {i} hung on a frozen agent"
                assert isinstance(err, DeadlineExceeded), (i, err)
                assert isinstance(err, KVClientError) and isinstance(err, grpc.RpcError)
                assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        finally:
            os.kill(agent.proc.pid, signal.SIGCONT)
        # Thawed: both clients serve again, the same-host one back on a lane.
        assert same(lane_c.get(ns[lane_c], ids), blocks_for(5, 2))
        assert lane_c.uses_local_lane
        assert plain.lookup(ns[plain], ids).matched == 2
    finally:
        lane_c.close()
        plain.close()


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout"):
        KVClient("127.0.0.1:1", use_shm=False, timeout=0)
