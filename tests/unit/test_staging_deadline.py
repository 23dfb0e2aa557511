"""The deadline a same-host call carries for its staging (node_agent.shm.staging_deadline,
kvstore.client.staging_times): the deadline itself where caller and agent share
CLOCK_MONOTONIC, and never a later one than the caller had where they do not."""

from __future__ import annotations

import time

import pytest

from kvstore.client import staging_times
from kvstore.errors import InvalidArgument
from node_agent.shm import staging_deadline

S = 1_000_000_000


def test_no_deadline_is_none():
    assert staging_deadline(0, 0, "x") is None


def test_a_caller_on_the_same_clock_keeps_its_deadline_to_the_nanosecond():
    now = time.monotonic_ns()
    assert staging_deadline(now + 3 * S, now - 5, "x") == now + 3 * S
    assert staging_deadline(now - S, now - 2 * S, "x") == now - S  # passed already: kept


def test_a_request_that_arrives_long_after_it_was_sent_keeps_its_passed_deadline():
    """A minute in a queue on the same clock: the deadline is long gone, and stays so
    (the caller gave up and may have written its staging since)."""
    now = time.monotonic_ns()
    assert staging_deadline(now - 60 * S, now - 61 * S, "x") == now - 60 * S


def test_a_caller_whose_clock_runs_ahead_gets_no_more_than_it_had_left():
    """A `sent` ahead of the agent's clock is another clock (a time namespace): the
    deadline becomes the time the caller had left, counted from now."""
    before = time.monotonic_ns()
    sent = before + 3600 * S
    got = staging_deadline(sent + 2 * S, sent, "x")
    after = time.monotonic_ns()
    assert got is not None and before + 2 * S <= got <= after + 2 * S


def test_a_caller_whose_clock_runs_behind_is_held_to_the_deadline_it_gave():
    """Behind the agent's clock, the deadline as given has passed already: the call is
    refused as late rather than given a window its caller never had."""
    now = time.monotonic_ns()
    sent = now - 3600 * S
    assert staging_deadline(sent + 2 * S, sent, "x") == sent + 2 * S < now


@pytest.mark.parametrize("deadline,sent", [(5, 0), (0, 5), (5, 6)])
def test_half_a_deadline_or_one_before_its_sending_is_refused(deadline, sent):
    with pytest.raises(InvalidArgument, match="CLOCK_MONOTONIC"):
        staging_deadline(deadline, sent, "staging_deadline_ns")


def test_the_client_sends_a_time_never_past_its_deadline():
    until, sent = staging_times(time.monotonic() + 5)
    assert 0 < sent < until
    until, sent = staging_times(time.monotonic() - 5)  # late already: sent == deadline
    assert sent == until
    assert staging_deadline(until, sent, "x") == until
