"""Gets into the shared-memory staging area that are held at once (`first_slot`) and Gets
in two halves (`begin_get_staged` sends, `finish_get_staged` reads the answer, what the
vLLM connector does while vLLM prepares a step): the same blocks as a plain Get on every
path, several sent at once, an answer another call read first, no lane, an agent
restarted in between, a frozen agent. Real agent processes."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from support.common import TEST_SECRET, make_namespace, prompt_tokens

from kvstore.client import DeadlineExceeded, KVClient
from kvstore.client.convert import block_shape, torch_dtype

SPEC = make_namespace()
BS = SPEC.block_size


def blocks_for(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(block_shape(SPEC), generator=g).to(torch_dtype(SPEC.kv_dtype)) for _ in range(n)
    ]


def same(got: torch.Tensor, want: list[torch.Tensor]) -> bool:
    return len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def lane_calls(c: KVClient) -> int:
    return dict(c.stats().counters)["local_lane_calls"]


def stored(c: KVClient, seed: int, n: int):
    ns = c.open_namespace(SPEC)
    ids = c.block_ids(ns, prompt_tokens(seed, n * BS))
    assert c.put(ns, ids, blocks_for(seed, n)).stored == n
    return ns, ids


def test_gets_into_disjoint_slots_are_held_at_once(spawn_agent):
    agent = spawn_agent()
    with KVClient(agent.address, tenant_secret=TEST_SECRET, shm_bytes=1 << 20) as c:
        ns, ids = stored(c, 1, 4)
        want = blocks_for(1, 4)
        head = c.get_staged_tensor(ns, ids[:2])
        tail = c.get_staged_tensor(ns, ids[2:], ids[1], first_slot=2)
        assert same(head, want[:2]) and same(tail, want[2:])
        cap = c.staging_capacity(ns)
        with pytest.raises(ValueError, match="at most"):
            c.get_staged_tensor(ns, ids[:2], first_slot=cap - 1)


def test_a_get_in_two_halves_serves_what_a_get_does(spawn_agent):
    agent = spawn_agent()
    with KVClient(agent.address, tenant_secret=TEST_SECRET, shm_bytes=1 << 20) as c:
        ns, ids = stored(c, 2, 3)
        want = blocks_for(2, 3)
        calls = lane_calls(c)
        pending = c.begin_get_staged(ns, ids, first_slot=1)
        assert same(c.finish_get_staged(pending), want)
        assert lane_calls(c) == calls + 1  # one Get, its answer read late
        # Two at once, into disjoint slots: the agent answers them in order.
        calls = lane_calls(c)
        first = c.begin_get_staged(ns, ids[:1])
        second = c.begin_get_staged(ns, ids[1:], ids[0], first_slot=1)
        head, tail = c.finish_get_staged(first), c.finish_get_staged(second)
        assert same(head, want[:1]) and same(tail, want[1:])
        assert lane_calls(c) == calls + 2
        # Finishing the later one first drops the earlier answer: that Get is made again.
        first = c.begin_get_staged(ns, ids[:1])
        second = c.begin_get_staged(ns, ids[1:], ids[0], first_slot=1)
        assert same(c.finish_get_staged(second), want[1:])
        assert same(c.finish_get_staged(first), want[:1])
        # Another call reads the answer first (one request at a time on the lane): the
        # Get is made again, and serves the same blocks.
        pending = c.begin_get_staged(ns, ids[1:], ids[0])
        assert c.lookup(ns, ids).matched == 3
        assert same(c.finish_get_staged(pending), want[1:])
        # A miss is a short answer, as from get_staged_tensor.
        other = c.block_ids(ns, prompt_tokens(3, BS))
        assert len(c.finish_get_staged(c.begin_get_staged(ns, ids[:1] + other))) == 1


def test_two_halves_without_a_lane_and_across_an_agent_restart(spawn_agent):
    agent = spawn_agent(default_policy={"persist": True})  # blocks outlive the restart
    grpc_shm = KVClient(
        agent.address, tenant_secret=TEST_SECRET, shm_bytes=1 << 20, local_lane=False
    )
    lane_c = KVClient(agent.address, tenant_secret=TEST_SECRET, shm_bytes=1 << 20)
    try:
        ns, ids = stored(lane_c, 4, 2)
        g_ns = grpc_shm.open_namespace(SPEC)
        assert same(
            grpc_shm.finish_get_staged(grpc_shm.begin_get_staged(g_ns, ids)), blocks_for(4, 2)
        )
        os.kill(agent.proc.pid, signal.SIGSTOP)  # the Get is sent, never answered ...
        pending = lane_c.begin_get_staged(ns, ids)
        agent.kill()  # ... by this process
        agent.config["listen"] = agent.address
        agent.start()
        with KVClient(agent.address, tenant_secret=TEST_SECRET, use_shm=False) as other:
            other.put(other.open_namespace(SPEC), ids, blocks_for(4, 2))  # held (again)
        assert same(lane_c.finish_get_staged(pending), blocks_for(4, 2))
        assert lane_c.reregistrations == 1 and lane_c.uses_local_lane
    finally:
        grpc_shm.close()
        lane_c.close()


def test_a_frozen_agent_fails_the_second_half_by_its_deadline(spawn_agent):
    agent = spawn_agent()
    with KVClient(agent.address, tenant_secret=TEST_SECRET, shm_bytes=1 << 20, timeout=1.0) as c:
        ns, ids = stored(c, 5, 2)
        os.kill(agent.proc.pid, signal.SIGSTOP)
        try:
            pending = c.begin_get_staged(ns, ids)
            with pytest.raises(DeadlineExceeded):
                c.finish_get_staged(pending)
        finally:
            os.kill(agent.proc.pid, signal.SIGCONT)
        assert same(c.get_staged_tensor(ns, ids), blocks_for(5, 2))  # thawed: serves again
