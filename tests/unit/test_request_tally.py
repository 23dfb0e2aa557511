"""node_agent/request_tally: each engine request counted once, whichever calls it made."""

from __future__ import annotations

import pytest

from node_agent.request_tally import RequestDelta, RequestLedger


def test_a_lookup_without_an_id_is_one_request():
    led = RequestLedger()
    assert led.lookup("t", "", 5, 3) == RequestDelta(1, 1, 5, 3)
    assert led.lookup("t", "", 5, 0) == RequestDelta(1, 0, 5, 0)


def test_a_get_without_an_id_counts_nothing():
    assert RequestLedger().get("t", "", 4, 4) == RequestDelta()


def test_a_get_alone_counts_its_request_once():
    led = RequestLedger()
    assert led.get("t", "r", 6, 4) == RequestDelta(1, 1, 6, 4)
    assert led.get("t", "r", 2, 2) == RequestDelta()
    assert led.lookup("t", "r", 6, 4) == RequestDelta()


def test_repeated_lookups_count_once_and_a_later_get_adds_nothing():
    led = RequestLedger()
    assert led.lookup("t", "r", 5, 4) == RequestDelta(1, 1, 5, 4)
    assert led.lookup("t", "r", 5, 4) == RequestDelta()
    assert led.get("t", "r", 2, 2) == RequestDelta()


def test_blocks_the_caller_holds_itself_are_neither_asked_nor_hit():
    """vLLM's own prefix cache held the leading blocks: kvstore's rates count the rest."""
    led = RequestLedger()
    assert led.lookup("t", "r", 6, 4, caller_held=2) == RequestDelta(1, 1, 4, 2)
    assert led.lookup("t", "s", 6, 1, caller_held=2) == RequestDelta(1, 0, 4, 0)
    assert led.lookup("t", "", 6, 6, caller_held=3) == RequestDelta(1, 1, 3, 3)
    # The engine held every block: kvstore had no part in it, nothing counts.
    assert led.lookup("t", "u", 4, 4, caller_held=4) == RequestDelta()
    assert led.lookup("t", "", 4, 4, caller_held=4) == RequestDelta()


def test_a_lookup_matching_more_later_raises_the_hit():
    """A miss at first, then the same request after a peer pull landed: one request, a hit
    of the blocks it got in the end."""
    led = RequestLedger()
    assert led.lookup("t", "r", 5, 0) == RequestDelta(1, 0, 5, 0)
    assert led.lookup("t", "r", 5, 3) == RequestDelta(0, 1, 0, 3)
    assert led.lookup("t", "r", 5, 4) == RequestDelta(0, 0, 0, 1)
    assert led.lookup("t", "r", 5, 2) == RequestDelta()


def test_tenants_do_not_share_request_ids():
    led = RequestLedger()
    led.lookup("a", "r", 2, 2)
    assert led.lookup("b", "r", 2, 1) == RequestDelta(1, 1, 2, 1)


def test_the_oldest_ids_are_forgotten_past_capacity():
    led = RequestLedger(capacity=2)
    for rid in ("r1", "r2", "r3"):
        led.lookup("t", rid, 1, 1)
    assert led.lookup("t", "r3", 1, 1) == RequestDelta()  # still known
    assert led.lookup("t", "r1", 1, 1) == RequestDelta(1, 1, 1, 1)  # forgotten: again


def test_one_tenants_fresh_ids_do_not_push_out_another_tenants():
    """The tester's flood (/tmp/probe1/ledger_flood.py): acme's fresh ids filled the one
    shared ledger and globex's retried request counted again."""
    led = RequestLedger(capacity=4)
    assert led.lookup("globex", "req-1", 10, 10) == RequestDelta(1, 1, 10, 10)
    for i in range(100):
        led.lookup("acme", f"flood-{i}", 1, 0)
    assert led.lookup("globex", "req-1", 10, 10) == RequestDelta()  # counted once
    assert led.get("globex", "req-1", 10, 10) == RequestDelta()
    assert led.lookup("acme", "flood-0", 1, 0) == RequestDelta(1, 0, 1, 0)  # its own: gone


def test_the_tenant_seen_least_recently_is_forgotten_past_max_tenants():
    led = RequestLedger(capacity=4, max_tenants=2)
    led.lookup("a", "r", 1, 1)
    led.lookup("b", "r", 1, 1)
    assert led.lookup("a", "r", 1, 1) == RequestDelta()  # a seen again: b is the oldest
    led.lookup("c", "r", 1, 1)  # a third tenant: b's ids go
    assert led.lookup("a", "r", 1, 1) == RequestDelta()
    assert led.lookup("b", "r", 1, 1) == RequestDelta(1, 1, 1, 1)


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity"):
        RequestLedger(capacity=0)
    with pytest.raises(ValueError, match="max_tenants"):
        RequestLedger(max_tenants=0)
