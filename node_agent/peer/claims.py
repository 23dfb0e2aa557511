"""De-duplication of concurrent Prefetches: the first call that needs a block claims it
and transfers it; later calls wait for its outcome instead of transferring it again."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from kvstore.store import NsState


@dataclass(slots=True, eq=False)
class ClaimRun:
    """ids[start:end]: transferred by this call (`mine`, with fresh futures it resolves)
    or by an earlier one (its futures: True once that call stored the block)."""

    start: int
    end: int
    mine: bool
    futures: list[asyncio.Future] = field(default_factory=list)


class Claims:
    """Blocks some Prefetch on this node is transferring: (namespace, generation, id) ->
    a future of whether it got stored."""

    def __init__(self) -> None:
        self._inflight: dict[tuple[bytes, int, bytes], asyncio.Future] = {}

    def claim(self, st: NsState, gen: int, ids: list[bytes], start: int) -> list[ClaimRun]:
        """Split ids[start:] into runs this call transfers and runs another call is
        already transferring. Claims happen without an await, so a later call only ever
        waits on earlier ones: no cycle, no deadlock."""
        runs: list[ClaimRun] = []
        loop = asyncio.get_running_loop()
        for i in range(start, len(ids)):
            key = (st.ns_id, gen, ids[i])
            fut = self._inflight.get(key)
            mine = fut is None
            if fut is None:
                fut = self._inflight[key] = loop.create_future()
            if runs and runs[-1].mine == mine:
                runs[-1].end = i + 1
                runs[-1].futures.append(fut)
            else:
                runs.append(ClaimRun(i, i + 1, mine, [fut]))
        return runs

    def release(
        self, st: NsState, gen: int, ids: list[bytes], futs: dict[int, asyncio.Future]
    ) -> None:
        """Resolve this call's claims (unstored ones as failed) and forget them."""
        for i, fut in futs.items():
            if not fut.done():
                fut.set_result(False)
            key = (st.ns_id, gen, ids[i])
            if self._inflight.get(key) is fut:
                del self._inflight[key]
