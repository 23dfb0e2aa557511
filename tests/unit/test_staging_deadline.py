"""The deadline a same-host call carries for its staging (node_agent.shm.staging_deadline,
kvstore.client.staging_times): read on the agent's clock where caller and agent share
CLOCK_MONOTONIC, counted from the call's arrival where they plainly do not."""

from __future__ import annotations

import time

import pytest

from kvstore.client import staging_times
from kvstore.errors import InvalidArgument
from node_agent.shm import ONE_CLOCK_NS, staging_deadline

S = 1_000_000_000


def test_no_deadline_is_none():
    assert staging_deadline(0, 0, "x") is None


def test_a_caller_on_the_same_clock_keeps_its_deadline_to_the_nanosecond():
    now = time.monotonic_ns()
    assert staging_deadline(now + 3 * S, now - 5, "x") == now + 3 * S
    assert staging_deadline(now - S, now - 2 * S, "x") == now - S  # passed already: kept


@pytest.mark.parametrize("skew", [3600 * S, -(ONE_CLOCK_NS + S)], ids=["ahead", "far-behind"])
def test_a_caller_on_another_clock_gets_its_time_left_from_arrival(skew):
    """A `sent` ahead of the agent's clock (or a minute behind) is another clock: the
    deadline becomes the time the caller had left, counted from now."""
    before = time.monotonic_ns()
    sent = before + skew
    got = staging_deadline(sent + 2 * S, sent, "x")
    after = time.monotonic_ns()
    assert got is not None and before + 2 * S <= got <= after + 2 * S


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
