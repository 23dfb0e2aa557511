"""loadtest/chat_workload.py's mode order for interleaved comparisons: over as many turns
as there are modes, every mode sends in every position once (no mode is always first)."""

from __future__ import annotations

import pytest

from loadtest.chat_workload import MODES, Chat, Workload, rotated


def test_every_mode_takes_every_position_once_per_cycle_of_turns():
    for start in range(3):
        orders = [rotated(MODES, t) for t in range(start, start + len(MODES))]
        assert all(sorted(o) == sorted(MODES) for o in orders)
        for pos in range(len(MODES)):
            assert sorted(o[pos] for o in orders) == sorted(MODES)
    assert rotated(MODES, 0) == MODES  # the first turn goes in the given order


def test_an_unknown_mode_is_refused_before_anything_is_sent():
    with pytest.raises(ValueError, match="mode must be one of"):
        Chat(Workload(("acme",), 1, 1), "random", "", {}, {})
