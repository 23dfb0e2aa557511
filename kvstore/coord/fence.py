"""The lease fence of a member (agent or router): it must not answer from its cache once
it cannot be sure its etcd lease is still alive.

Why: `kvctl flush` waits for every *live* member. A member whose lease expired (frozen by
SIGSTOP, a long GC or VM pause, cut off from etcd) drops out of that set, so the flush
returns 0 without it; when it wakes up it still holds the old generation until its watch
or its next keepalive tells it otherwise. The fence closes that window on the request
path: every lookup asks `fenced()`, which compares time.monotonic() (it keeps counting
while the process is stopped) with the moment the lease was last confirmed.

The arithmetic: a keepalive (or grant) sent at monotonic time S and answered with a TTL
of T keeps the lease in etcd until at least S + T (etcd renews it when it receives the
request, after S). We serve until S + T - margin only, so by the time etcd could have
expired the lease (and a flush could have stopped waiting for us) we answer misses. The
margin covers the two hosts' clocks running at slightly different rates.

Once fenced, `fenced()` stays true until the owner re-joined: re-registered (or renewed
the same lease) *and* re-read every namespace generation and the kill switch from etcd
(`ControlFollower.catch_up`), then called `confirmed(S)`. A member starts fenced: it
serves hits only once it is registered.

Unless etcd went out of reach while the member was current: once etcd calls failed for
want of etcd twice in a row (`unreachable()`: refused, timed out), the first of them sent
while the lease was still surely alive, the member serves the generations it knows, as
the design asks of an etcd outage ("the data path keeps serving with the last known
generations"): no flush commits while etcd is down, so nothing it knew then is stale. A
member frozen past its lease stays fenced when it wakes up, whether etcd answers (its
lease gone: it re-reads etcd) or not (its calls were sent after the lapse). What stays
open is a member cut off from etcd while `kvctl` still reaches it (a partition): it
serves the generations it knew until it reaches etcd again, and a flush meanwhile returns
0 without it (flush names the members that left during it; docs/runbook.md).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

log = logging.getLogger("kvstore.fence")


def fence_margin(ttl_s: float) -> float:
    """Seconds before the lease's earliest expiry at which we stop serving hits: a
    quarter of the TTL (keepalives go every third of it, so one late keepalive does not
    fence), at most 2 s."""
    return min(ttl_s / 4.0, 2.0)


class LeaseFence:
    def __init__(
        self,
        ttl_s: float,
        what: str,
        clock: Callable[[], float] = time.monotonic,
        margin_s: float | None = None,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease ttl must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self.margin_s = fence_margin(ttl_s) if margin_s is None else margin_s
        self.what = what
        self._clock = clock
        self._valid_until = -math.inf  # fenced until the first registration
        self._confirmed_at = -math.inf  # send time of the last renewal that counted
        self._joined = False  # registered at least once
        self._episode = False  # fenced, and said so in the log
        self.episodes = 0
        self._failures = 0  # etcd calls failed for want of etcd, in a row
        self._streak_sent = math.inf  # when the first of them was sent
        self._outage_said = False

    # ----------------------------------------------------------------- the check
    def fenced(self) -> bool:
        """True while the lease may have expired (or was never confirmed): answer a miss."""
        if self._clock() < self._valid_until:
            return False
        if self.out_of_reach:
            return False
        if not self._episode and self._joined:
            self._episode = True
            self.episodes += 1
            log.warning(
                "%s: etcd lease not confirmed for %.1fs (ttl %gs): answering every lookup "
                "as a miss and serving no blocks to peers until it has re-registered and "
                "re-read the namespace generations from etcd",
                self.what,
                self._clock() - self._confirmed_at,
                self.ttl_s,
            )
        return True

    @property
    def out_of_reach(self) -> bool:
        """etcd failed twice in a row for want of etcd (one failure can be a connection
        reset by a frozen member's wake-up: still fenced), and the first of those calls
        was sent while the lease was still surely alive: the member was current when etcd
        went away, so no flush can have gone on without it. A member already past its
        lease when etcd went away (frozen, then woken up to an etcd out of reach), or
        never registered, stays fenced."""
        return self._joined and self._failures >= 2 and self._streak_sent < self._valid_until

    def unreachable(self, sent_at: float | None = None) -> None:
        """An etcd call (grant, keepalive, registration) sent at `sent_at` (monotonic;
        default: now, the cautious guess) failed for want of etcd."""
        if not self._failures:
            self._streak_sent = self._clock() if sent_at is None else sent_at
        self._failures += 1
        if self.out_of_reach and not self._outage_said:
            self._outage_said = True
            log.warning(
                "%s: etcd out of reach: serving the generations known here (no flush can "
                "commit without etcd), past the lease too, until etcd answers; then they "
                "are re-read before more hits",
                self.what,
            )

    def lapsed_at(self, t: float) -> bool:
        """Whether the fence was (or would have been) up at monotonic time `t`: a renewal
        sent then must re-read etcd before it lifts the fence."""
        return t >= self._valid_until

    # ----------------------------------------------------------------- the owner
    def confirmed(self, sent_at: float, ttl_s: float | None = None) -> None:
        """A keepalive or grant sent at `sent_at` (monotonic) was answered with `ttl_s`
        (default: ours). Call it after a renewal whose send time was not `lapsed_at`,
        or after the re-registration and catch-up that follow a lapse."""
        self._failures, self._streak_sent, self._outage_said = 0, math.inf, False
        ttl = self.ttl_s if ttl_s is None else min(float(ttl_s), self.ttl_s)
        if sent_at + ttl - self.margin_s > self._valid_until:
            self._valid_until = sent_at + ttl - self.margin_s
            self._confirmed_at = sent_at
        if self._clock() >= self._valid_until:
            return  # already stale again (the catch-up took too long): stays fenced
        if self._episode:
            log.warning(
                "%s: re-registered in etcd and re-read the generations: serving hits again",
                self.what,
            )
            self._episode = False
        self._joined = True

    def lost(self) -> None:
        """The lease is gone (expired, revoked, our key taken): fenced at once (etcd
        answered, so it is in reach)."""
        self._valid_until = -math.inf
        self._failures, self._streak_sent, self._outage_said = 0, math.inf, False
        if self._joined and not self._episode:
            self.fenced()  # logs the episode
