"""How a peer transfer fails, and the bounded wait every network await goes through."""

from __future__ import annotations

import asyncio
import time

from kvstore import errors


class PeerTransportError(errors.Unavailable):
    """The transfer broke (connection, timeout, protocol): another transport may work."""


class PeerUnreachable(PeerTransportError):
    """The connection to the peer failed or was not a kvstore peer's. Its message (for
    the log) quotes what the network said; `public` (for the Prefetch's caller, who chose
    the address) only which transport and address, and the status name: the network's
    words told a tenant whether a port of any host was open, what served there, and
    whether a name resolved."""

    def __init__(self, message: str, public: str) -> None:
        super().__init__(message)
        self.public = public


class PeerRefused(errors.KvError):
    """The peer answered but will not serve (unknown namespace, generation, access)."""


async def within(aw, deadline: float, io_timeout: float, what: str):
    """Await `aw` for at most io_timeout and never past the deadline."""
    left = min(io_timeout, deadline - time.monotonic())
    if left <= 0:
        if asyncio.iscoroutine(aw):
            aw.close()
        elif isinstance(aw, asyncio.Future):
            aw.cancel()
        raise PeerTransportError(f"deadline passed before {what}")
    try:
        async with asyncio.timeout(left):
            return await aw
    except asyncio.TimeoutError:
        raise PeerTransportError(f"timed out after {left:.1f}s waiting for {what}") from None
