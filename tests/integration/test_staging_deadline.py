"""A same-host Put or Get never works on a caller's staging past the caller's deadline.

A caller told its call failed (DEADLINE_EXCEEDED) may write its staging again at once.
A Put whose copy out of staging ran on past that moment would store blocks from bytes
half old, half new, each with a checksum of what was read: served as valid. So the
client sends its deadline on CLOCK_MONOTONIC (PutRequest.staging_deadline_ns, ShmTarget.
deadline_ns) and the agent stores nothing from a copy that ended past it, and copies
nothing into staging once it has passed. Against a real agent, over the local lane and
over gRPC.
"""

from __future__ import annotations

import time

import grpc
import pytest
import torch
from support.common import TEST_SECRET, make_namespace, prompt_tokens

from kvstore import lane
from kvstore.client import KVClient
from kvstore.client.convert import block_shape, torch_dtype
from kvstore.client.errors import DeadlineExceeded
from kvstore.client.local_lane import LaneDeadline
from kvstore.v1 import agent_pb2

MiB = 1 << 20
SMALL = make_namespace()  # 4 KiB blocks: a Put copied inline, in one step
BIG = make_namespace(name="big", num_layers=32, num_kv_heads=8, head_dim=128)  # 2 MiB


def blocks_for(spec, seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(block_shape(spec), generator=g).to(torch_dtype(spec.kv_dtype)) for _ in range(n)
    ]


def counter(c: KVClient, name: str) -> int:
    return dict(c.stats().counters).get(name, 0)


def past() -> tuple[int, int]:
    """(deadline, sent) a second and two ago, on this host's CLOCK_MONOTONIC."""
    now = time.monotonic_ns()
    return now - 1_000_000_000, now - 2_000_000_000


def chain_put(c: KVClient, ns, ids: list[bytes], deadline: int, sent: int):
    """The Put put_staged sends for `ids` from staging slot 0 on, with these times."""
    return agent_pb2.PutRequest(
        ns=ns.ref,
        shm_region_id=c._region_id,
        root=ns.root,
        chain_ids=b"".join(ids),
        chain_parent_id=ns.root,
        chain_stride=ns.block_bytes,
        staging_deadline_ns=deadline,
        staging_sent_ns=sent,
    )


def staged_get(c: KVClient, ns, ids: list[bytes], deadline: int, sent: int):
    """A Get of `ids` into staging slots 0.., with these times."""
    return agent_pb2.GetRequest(
        ns=ns.ref,
        block_ids=b"".join(ids),
        parent_id=ns.root,
        shm=agent_pb2.ShmTarget(
            region_id=c._region_id,
            offsets=[i * ns.block_bytes for i in range(len(ids))],
            deadline_ns=deadline,
            sent_ns=sent,
        ),
    )


@pytest.fixture
def agent(spawn_agent):
    return spawn_agent(pool_bytes="64MiB", slot_bytes="2MiB", nvme_bytes=0)


# 3 blocks of 4 KiB: copied inline. 5 of 2 MiB (10 MiB): copied on threads of their own,
# waited for on the event loop (the big-batch path).
@pytest.mark.parametrize("spec,n", [(SMALL, 3), (BIG, 5)], ids=["inline", "background"])
@pytest.mark.parametrize("local_lane", [True, False], ids=["lane", "grpc"])
def test_a_put_past_its_deadline_stores_nothing(agent, spec, n, local_lane):
    """Refused on arrival, nothing copied (a copy that ends past the deadline stores
    nothing either: tests/unit/test_store_background.py, and the end-to-end test below)."""
    with KVClient(
        agent.address, tenant_secret=TEST_SECRET, shm_bytes=16 * MiB, local_lane=local_lane
    ) as c:
        assert c.uses_shm and c.uses_local_lane == local_lane
        ns = c.open_namespace(spec)
        ids = c.block_ids(ns, prompt_tokens(1, n * spec.block_size))
        blocks = blocks_for(spec, 1, n)
        for v, b in zip(c.staging_views(ns, n), blocks):
            v.copy_(b)
        req = chain_put(c, ns, ids, *past())
        if local_lane:
            with pytest.raises(LaneDeadline) as exc:
                c._lane.call(lane.PUT, req, agent_pb2.PutResponse, 10.0)
            assert isinstance(exc.value, DeadlineExceeded)
        else:
            with pytest.raises(grpc.RpcError) as exc:
                c.stub.Put(iter([req]), metadata=c._md, timeout=10.0)
        assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "nothing copied" in exc.value.details()  # refused before any work
        assert c.lookup(ns, ids).matched == 0
        assert counter(c, "put_past_deadline") == 1
        # Every slot went back, the connection is still in step (no new registration),
        # and the same blocks within their deadline land whole.
        before = c.reregistrations
        assert c.put_staged(ns, ids).stored == n
        assert c.reregistrations == before
        got = c.get(ns, ids)
        assert len(got) == n and all(torch.equal(a, b) for a, b in zip(got, blocks))


@pytest.mark.parametrize("spec,n", [(SMALL, 3), (BIG, 5)], ids=["inline", "background"])
def test_a_get_past_its_deadline_writes_nothing_into_staging(agent, spec, n):
    with KVClient(agent.address, tenant_secret=TEST_SECRET, shm_bytes=16 * MiB) as c:
        ns = c.open_namespace(spec)
        ids = c.block_ids(ns, prompt_tokens(2, n * spec.block_size))
        blocks = blocks_for(spec, 2, n)
        assert c.put(ns, ids, blocks).stored == n
        views = c.staging_views(ns, n)
        for v in views:
            v.fill_(7)  # what the caller wrote there after its Get failed
        req = staged_get(c, ns, ids, *past())
        with pytest.raises(DeadlineExceeded, match="nothing written"):
            c._lane.call(lane.GET, req, agent_pb2.GetResponse, 10.0)
        assert all(bool((v == 7).all()) for v in views)
        assert counter(c, "get_past_deadline") == 1
        # The blocks were let go of (the read holds ended) and serve as before.
        got = c.get_views(ns, ids)
        assert len(got) == n and all(torch.equal(a, b) for a, b in zip(got, blocks))


def test_a_put_that_ran_out_of_time_leaves_nothing_stored_from_rewritten_staging(spawn_agent):
    """What the deadline is for, end to end: put_staged of 60 MiB with a 1 ms deadline
    fails (no host copies that in time), the caller at once writes other bytes into the
    same staging, and none of the blocks is stored, from either set of bytes."""
    agent = spawn_agent(pool_bytes="128MiB", slot_bytes="2MiB", nvme_bytes=0)
    n = 30
    with KVClient(agent.address, tenant_secret=TEST_SECRET, shm_bytes=n * 2 * MiB) as c:
        ns = c.open_namespace(BIG)
        ids = c.block_ids(ns, prompt_tokens(3, n * BIG.block_size))
        views = c.staging_views(ns, n)
        first, second = blocks_for(BIG, 3, n), blocks_for(BIG, 4, n)
        for _ in range(5):  # until the Put went out before its deadline (a stall may stop it)
            c.lookup(ns, ids[:1])  # registered again (if the last pass dropped the lane)
            for v, b in zip(views, first):
                v.copy_(b)
            with pytest.raises(DeadlineExceeded) as exc:
                c.put_staged(ns, ids, timeout=0.001)
            if "before the call" not in exc.value.details():
                break
        else:
            pytest.fail("five Puts in a row found their 1 ms gone before they were sent")
        for v, b in zip(views, second):  # the caller reuses its staging right away
            v.copy_(b)
        limit = time.monotonic() + 30
        # The agent refused it on arrival, or stored nothing once its copy was over.
        while counter(c, "put_past_deadline") < 1:
            assert time.monotonic() < limit, "the agent never ended the late Put"
            time.sleep(0.01)
        assert c.lookup(ns, ids).matched == 0
        assert c.put_staged(ns, ids).stored == n
        got = c.get(ns, ids)
        assert len(got) == n and all(torch.equal(a, b) for a, b in zip(got, second))


@pytest.mark.parametrize(
    "deadline,sent",
    [(5, 0), (0, 5), (5, 6)],
    ids=["no-sent-time", "no-deadline", "sent-after-deadline"],
)
def test_a_malformed_deadline_is_refused_before_any_work(agent, deadline, sent):
    with KVClient(agent.address, tenant_secret=TEST_SECRET, shm_bytes=16 * MiB) as c:
        ns = c.open_namespace(SMALL)
        ids = c.block_ids(ns, prompt_tokens(5, 2 * SMALL.block_size))
        put = chain_put(c, ns, ids, deadline, sent)
        get = staged_get(c, ns, ids, deadline, sent)
        for method, req, resp in (
            (lane.PUT, put, agent_pb2.PutResponse),
            (lane.GET, get, agent_pb2.GetResponse),
        ):
            with pytest.raises(grpc.RpcError) as exc:
                c._lane.call(method, req, resp, 10.0)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "CLOCK_MONOTONIC" in exc.value.details()
        assert c.lookup(ns, ids).matched == 0


def test_an_answered_deadline_keeps_the_lane_and_a_silent_one_drops_it(agent):
    """DEADLINE_EXCEEDED answered by the agent (LaneDeadline) leaves the connection in
    step: the client carries on over it. No answer by the deadline leaves it out of
    step: the client drops it and registers again on its next call."""
    with KVClient(agent.address, tenant_secret=TEST_SECRET, shm_bytes=16 * MiB) as c:
        ns = c.open_namespace(SMALL)
        ids = c.block_ids(ns, prompt_tokens(6, 2 * SMALL.block_size))
        lane_before = c._lane
        with pytest.raises(DeadlineExceeded), c._lane_errors():
            raise LaneDeadline("the agent's verdict")
        assert c._lane is lane_before and not c._stale
        assert c.lookup(ns, ids).matched == 0 and c.reregistrations == 0
        with pytest.raises(DeadlineExceeded), c._lane_errors():
            raise DeadlineExceeded("no answer in time")
        assert c._lane is None and c._stale
        assert c.lookup(ns, ids).matched == 0 and c.reregistrations == 1
        assert c.uses_local_lane
