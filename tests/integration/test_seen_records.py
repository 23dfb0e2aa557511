"""`kvctl nodes forget` through kvstore.coord.seen.forget, on a real etcd: `router:X` drops
the router's record only (it dropped an agent X's record too), a bare id both kinds'."""

from __future__ import annotations

import asyncio

from kvstore.coord.etcd import EtcdClient
from kvstore.coord.seen import forget, list_seen, seen_key


def test_forgetting_a_router_leaves_the_agent_of_that_id(etcd):
    async def main() -> tuple[list[str], list[tuple[str, str]], list[str]]:
        async with EtcdClient(etcd.endpoint) as c:
            for kind in ("agent", "router"):
                await c.put(seen_key(kind, "x"), b'{"at": 1.0, "address": "a:1"}')
            gone = await forget(c, "router:x")
            left = sorted((s.kind, s.member_id) for s in await list_seen(c))
            return gone, left, await forget(c, "x")

    gone, left, then = asyncio.run(main())
    assert gone == [seen_key("router", "x")]
    assert left == [("agent", "x")]
    assert then == [seen_key("agent", "x")]
