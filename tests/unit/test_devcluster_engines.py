"""The dev cluster's agents can hold its engines' KV blocks (`kvctl cluster up --engines`,
what `make run` and the gateway benchmark start): with 64 KiB slots every Lookup and Put
of the tiny model's 128 KiB blocks was refused, so the engines only ever recomputed."""

from __future__ import annotations

from kvstore.devcluster import UpOptions, agent_slot_bytes
from kvstore.devengines import (
    MODEL_HEADS,
    MODEL_HIDDEN,
    MODEL_KV_HEADS,
    MODEL_LAYERS,
    EngineLaunch,
    model_block_bytes,
)
from tests.support.common import make_namespace


def test_agent_slots_hold_one_block_of_the_engines_model():
    block = EngineLaunch.__dataclass_fields__["block_size"].default
    spec = make_namespace(num_layers=MODEL_LAYERS, num_kv_heads=MODEL_KV_HEADS,
                          head_dim=MODEL_HIDDEN // MODEL_HEADS, kv_dtype="float32",
                          block_size=block)  # fmt: skip
    assert model_block_bytes(block) == spec.block_bytes  # what the connector's blocks take
    assert agent_slot_bytes(UpOptions(engines=2)) >= spec.block_bytes
    assert agent_slot_bytes(UpOptions(engines=0)) == 64 << 10  # no engines: as configured
