"""With mTLS on, the same-host data path carries no TLS (issue 18: "TLS costs
control-path latency only"): blocks put and got through shared memory, and the Lookups
and Gets over the local lane, put not one byte on the agent's TLS connection, which a
counting relay between client and agent sees (tests/support/tcp_count.py). The relay is
shown to see data traffic: a client without shared memory moves the blocks through it."""

from __future__ import annotations

import torch
from support.common import TEST_SECRET, make_namespace
from support.tcp_count import CountingRelay

from kvstore.client import KVClient
from kvstore.client.convert import block_shape, torch_dtype

SPEC = make_namespace(name="tls-data-path")  # 2 layers, 2 heads, 16 dims: 4 KiB blocks
N = 32


def blocks(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (N, SPEC.block_bytes), dtype=torch.uint8, generator=g)
    return [r.view(torch_dtype(SPEC.kv_dtype)).view(block_shape(SPEC)) for r in raw]


def round_trip(c: KVClient, ns, seed: int) -> None:
    data = blocks(seed)
    ids = c.block_ids(ns, list(range(seed * 10_000, seed * 10_000 + N * SPEC.block_size)))
    assert c.put(ns, ids, data).stored == N
    assert c.lookup(ns, ids).matched == N
    got = c.get(ns, ids)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, data))


def test_same_host_data_path_puts_nothing_on_the_tls_connection(spawn_agent, pki):
    agent = spawn_agent(**pki.section(), pool_bytes="16MiB", slot_bytes="64KiB")
    relay = CountingRelay(agent.address)
    try:
        with KVClient(
            relay.address, tenant_secret=TEST_SECRET, tls=pki.client, shm_bytes=1 << 20
        ) as c:
            assert c.uses_local_lane  # registered over the lane, found over mTLS
            ns = c.open_namespace(SPEC)  # control path: over TLS
            before = relay.bytes
            assert before > 0
            for seed in range(1, 4):
                round_trip(c, ns, seed)
            # 3 x 128 KiB each way moved, not one block of it over TLS: what the relay
            # carries meanwhile is the connection's own late frames after the handshake
            # (a session ticket, HTTP/2 settings: ~170 bytes here), far below one block.
            assert relay.bytes - before < SPEC.block_bytes // 4

        with KVClient(relay.address, tenant_secret=TEST_SECRET, tls=pki.client, use_shm=False) as g:
            ns = g.open_namespace(SPEC)
            start = relay.bytes
            round_trip(g, ns, 9)
            assert relay.bytes - start > 2 * N * SPEC.block_bytes  # put and get, on TLS
    finally:
        relay.close()
