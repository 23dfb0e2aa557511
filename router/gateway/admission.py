"""Admission before work on a prompt, and the threads that tokenize large ones.

A tenant's request counts against its `max_inflight_per_tenant` from admission, before
its prompt is tokenized, to its release (`preparing` until it is forwarded, then the
gateway's forwarded count): tokenizing is the gateway's own costly work, and before, a
tenant's prompts being tokenized counted nowhere, so one tenant could keep every core
busy with 4 MiB prompts. Large prompts (parsing and tokenizing) run on a pool of
`tokenize_threads` threads, at most `max_tokenizing_per_tenant` of one tenant at a time;
its others wait their turn, holding no thread, so another tenant's prompt waits behind at
most that many per tenant."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["Admission"]

T = TypeVar("T")


class Admission:
    def __init__(self, threads: int, per_tenant: int) -> None:
        self.preparing: Counter[str] = Counter()  # admitted, not yet forwarded
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="gateway-tokenize")
        self._per_tenant = per_tenant
        self._turns: dict[str, asyncio.Semaphore] = {}
        self._waiting: Counter[str] = Counter()  # holders and waiters of each semaphore

    @contextlib.contextmanager
    def prepare(self, tenant: str) -> Iterator[Callable[[int], None]]:
        """Counts the request as the tenant's while the body holds: as one, and more
        once the function it yields is called (its other choices, once its body says)."""
        held = 1
        self.preparing[tenant] += 1

        def more(n: int) -> None:
            nonlocal held
            self.preparing[tenant] += n
            held += n

        try:
            yield more
        finally:
            self.preparing[tenant] -= held
            if self.preparing[tenant] <= 0:
                del self.preparing[tenant]

    async def run(self, tenant: str, fn: Callable[[], T]) -> T:
        """`fn()` on the pool, in the tenant's turn."""
        turn = self._turns.get(tenant)
        if turn is None:
            turn = self._turns[tenant] = asyncio.Semaphore(self._per_tenant)
        self._waiting[tenant] += 1
        try:
            async with turn:
                job = asyncio.get_running_loop().run_in_executor(self._pool, fn)
                try:
                    return await asyncio.shield(job)
                except asyncio.CancelledError:
                    # The thread runs on whatever the caller does: its turn ends with it.
                    await asyncio.wait({job})
                    raise
        finally:
            self._waiting[tenant] -= 1
            if self._waiting[tenant] <= 0:
                del self._waiting[tenant], self._turns[tenant]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
