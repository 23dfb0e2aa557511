"""The peer transfer slots a serving agent shares between tenants
(node_agent/peer/serve.TransferSlots): one tenant whose transfers stall (a receiver that
never reads its payloads) cannot take them all (an attacker held all 4 of an agent's
slots and every other tenant's pulls waited out the io timeout)."""

from __future__ import annotations

import asyncio

from node_agent.peer.serve import TransferSlots


async def _held(slots: TransferSlots, share: str, release: asyncio.Event, started: list) -> None:
    async with slots.hold(share):
        started.append(share)
        await release.wait()


def test_one_tenant_takes_all_but_one_slot_and_another_still_gets_one():
    async def main() -> None:
        slots = TransferSlots(4)
        release, started = asyncio.Event(), []
        stalls = [asyncio.create_task(_held(slots, "acme", release, started)) for _ in range(5)]
        await asyncio.sleep(0.05)
        assert started == ["acme"] * 3  # its share: 3 of 4; the other two wait
        other = asyncio.create_task(_held(slots, "globex", asyncio.Event(), started))
        await asyncio.sleep(0.05)
        assert started[-1] == "globex"  # served at once, beside the stalled ones
        other.cancel()
        release.set()
        await asyncio.gather(*stalls)
        assert started.count("acme") == 5
        assert not slots._shares and not slots._users  # idle shares are forgotten

    asyncio.run(main())


def test_with_one_slot_a_tenant_may_use_it():
    async def main() -> None:
        slots = TransferSlots(1)
        async with slots.hold("acme"):
            pass

    asyncio.run(asyncio.wait_for(main(), 5))


def test_a_waiting_share_holds_none_of_the_others_slots():
    """A tenant queued behind its own share takes no slot of all while it waits."""

    async def main() -> None:
        slots = TransferSlots(2)  # acme's share: 1
        release, started = asyncio.Event(), []
        first = asyncio.create_task(_held(slots, "acme", release, started))
        queued = asyncio.create_task(_held(slots, "acme", release, started))
        await asyncio.sleep(0.05)
        assert started == ["acme"]
        async with slots.hold("globex"):  # the second slot is free for globex
            started.append("globex")
        assert started == ["acme", "globex"]
        release.set()
        await asyncio.gather(first, queued)

    asyncio.run(asyncio.wait_for(main(), 5))
