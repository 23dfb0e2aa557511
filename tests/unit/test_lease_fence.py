"""The lease fence (kvstore/coord/fence.py) on an injected clock: hits only while the lease
is surely alive; past it misses, unless etcd is out of reach (two failed calls in a row),
when the member serves the generations it knows, as the design asks of an etcd outage."""

from __future__ import annotations

import logging

from kvstore.coord.fence import LeaseFence


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_fenced_until_registered_then_until_the_lease_may_have_lapsed():
    clock = Clock()
    fence = LeaseFence(4.0, "agent a", clock)  # margin: a quarter, 1 s
    assert fence.fenced()
    fence.confirmed(sent_at=100.0)
    clock.t = 102.9
    assert not fence.fenced()
    clock.t = 103.0  # sent + ttl - margin
    assert fence.fenced()


def test_one_failed_call_keeps_the_fence_two_serve_the_known_generations(caplog):
    clock = Clock()
    fence = LeaseFence(4.0, "agent a", clock)
    fence.confirmed(sent_at=100.0)
    fence.unreachable(sent_at=101.0)  # one failure can be a stale connection: still fenced
    clock.t = 110.0
    assert fence.fenced() and not fence.out_of_reach
    with caplog.at_level(logging.WARNING, logger="kvstore.fence"):
        fence.unreachable(sent_at=104.0)
        assert not fence.fenced() and not fence.fenced()
        fence.unreachable(sent_at=107.0)
    assert sum("etcd out of reach" in r.message for r in caplog.records) == 1


def test_etcd_answering_ends_the_outage_mode():
    clock = Clock()
    fence = LeaseFence(4.0, "agent a", clock)
    fence.confirmed(sent_at=100.0)
    fence.unreachable(sent_at=101.0)
    fence.unreachable(sent_at=102.0)
    clock.t = 110.0
    assert not fence.fenced()
    fence.lost()  # etcd answered: our lease is gone; fenced until re-read
    assert fence.fenced()
    fence.confirmed(sent_at=110.0)  # re-registered and re-read the generations
    assert not fence.fenced()
    clock.t = 120.0
    fence.unreachable()  # failures counted afresh after a confirmation
    assert fence.fenced()


def test_a_member_past_its_lease_when_etcd_went_away_stays_fenced():
    """Frozen past its lease, then woken up to an etcd out of reach: a flush may have gone
    on without it before etcd went away, so failed calls sent after the lapse do not
    count as an outage it was current for."""
    clock = Clock()
    fence = LeaseFence(4.0, "agent a", clock)
    fence.confirmed(sent_at=100.0)
    clock.t = 110.0
    fence.unreachable(sent_at=110.0)
    fence.unreachable(sent_at=111.5)
    assert fence.fenced() and not fence.out_of_reach


def test_an_outage_that_began_while_current_serves_past_the_lease():
    clock = Clock()
    fence = LeaseFence(4.0, "agent a", clock)
    fence.confirmed(sent_at=100.0)
    fence.unreachable(sent_at=101.3)  # the next keepalive, sent within the lease, failed
    clock.t = 104.5
    fence.unreachable(sent_at=103.0)
    assert fence.out_of_reach and not fence.fenced()


def test_never_registered_means_fenced_even_with_etcd_out_of_reach():
    fence = LeaseFence(4.0, "agent a", Clock())
    fence.unreachable()
    fence.unreachable()
    assert fence.fenced()
