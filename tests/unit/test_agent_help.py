"""kvstore-agent --help states each sizing flag's default, taken from AgentConfig itself
(the operator choosing --pool-bytes saw no default, nor where --data-dir goes)."""

from __future__ import annotations

import pytest

from kvstore.config import AgentConfig
from kvstore.units import format_size
from node_agent.__main__ import parse_args


def test_the_help_states_the_defaults_of_the_config(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    d = AgentConfig()
    for said in (
        f"(default {d.node_id})",
        f"default {d.listen})",
        f"(default {format_size(d.pool_bytes)})",
        f"(default {format_size(d.slot_bytes)})",
        f"(default {format_size(d.nvme_bytes)})",
        f"(default {d.data_dir}, under the directory the agent starts in)",
        f"(default {d.eviction})",
        "(default none: run without etcd)",
    ):
        assert said in out, said
