"""Members seen: a lease-less record per agent and router, so `kvctl status` can tell a
member that died (its leased nodes/ or routers/ key expired with it) from one that never
existed, and from one that stopped cleanly.

Keys under the EtcdClient prefix::

    seen/agent/<node_id>      {"at": unix seconds, "address": ..., "stopped": unix seconds}
    seen/router/<router_id>   {"at": unix seconds, "address": ...}

`SeenWriter` runs in the member's own process, next to its registration: it writes the
record when the member's membership key is live (the `live` event: the agent's
`Registration.registered`, the router's `LeasedKey.live`) and again every `interval_s`
while it stays live, so `at` is never older than `interval_s` for a member that is
alive. The record has no lease: it outlives the process. A member that stops cleanly
(SIGTERM: it leaves etcd itself) adds `stopped`, the time it stopped, so `kvctl status`
shows it as stopped rather than missing; one that vanished (killed, frozen past its
lease, cut off) keeps a record without `stopped`: missing. The member's next write, when
it comes back, drops the mark. `kvctl nodes forget ID` deletes the record of a member
decommissioned for good. A router that stops cleanly deletes its own record instead
(`forget_on_stop`): router ids are pod names, replaced by every rollout, so a mark would
list every old pod as stopped for a day, while an agent's id (host and GPU) comes back
when it restarts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

from kvstore.coord.etcd import EtcdClient
from kvstore import errors

SEEN = "seen/"
KINDS = ("agent", "router")
INTERVAL_S = 60.0

log = logging.getLogger("kvstore.seen")


def seen_key(kind: str, member_id: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return f"{SEEN}{kind}/{member_id}"


@dataclass(frozen=True, slots=True)
class Seen:
    kind: str  # agent | router
    member_id: str
    at: float  # unix seconds of the last write
    address: str = ""
    stopped_at: float = 0.0  # unix seconds of a clean stop; 0: running, or vanished


async def list_seen(etcd: EtcdClient) -> list[Seen]:
    """Every seen record (damaged ones skipped)."""
    _, items = await etcd.list(SEEN)
    out = []
    for kv in items:
        kind, _, member_id = kv.key[len(SEEN) :].partition("/")
        try:
            d = json.loads(kv.value)
            stopped = float(d.get("stopped") or 0.0)
            out.append(Seen(kind, member_id, float(d["at"]), str(d.get("address", "")), stopped))
        except (ValueError, KeyError, TypeError):
            continue
    return out


async def forget(etcd: EtcdClient, member_id: str) -> list[str]:
    """Delete the seen records of `member_id`: `router:ID` a router's only, a bare id an
    agent's or a router's of that id; returns the keys deleted."""
    kinds: tuple[str, ...]
    if member_id.startswith("router:"):
        kinds, mid = ("router",), member_id.removeprefix("router:")
    else:
        kinds, mid = KINDS, member_id
    gone = []
    for kind in kinds:
        key = seen_key(kind, mid)
        if await etcd.delete(key):
            gone.append(key)
    return gone


async def forget_every_member(etcd: EtcdClient) -> int:
    """Delete every seen record (a new set of members starts: `kvctl cluster up` on the
    etcd of its last run); returns how many."""
    _, items = await etcd.list(SEEN)
    for kv in items:
        await etcd.delete(kv.key)
    return len(items)


class SeenWriter:
    """Write seen/<kind>/<id> whenever `live` is set, then every `interval_s` while it
    stays set. Failures are retried quietly (etcd down: the data path keeps serving).
    `stop` (a clean stop) marks the record stopped, or deletes it (`forget_on_stop`)."""

    def __init__(
        self,
        etcd: EtcdClient,
        kind: str,
        member_id: str,
        live: asyncio.Event,
        address: str = "",
        interval_s: float = INTERVAL_S,
        forget_on_stop: bool = False,
    ) -> None:
        self.etcd = etcd
        self.key = seen_key(kind, member_id)
        self.live = live
        self.address = address
        self.interval_s = interval_s
        self.forget_on_stop = forget_on_stop
        self.written = asyncio.Event()  # set after the first write (tests)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"seen-{self.key}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        # Only a record this process wrote: a member started twice under one id waits,
        # never live, and must not delete or mark the record of the one that runs.
        if not self.written.is_set():
            return
        try:
            if self.forget_on_stop:
                await self.etcd.delete(self.key)
            else:
                await self.etcd.put(self.key, self._value(stopped=True))
        except errors.KvError as exc:  # the record stays as it was: missing, not stopped
            log.warning("could not record the stop in %s in etcd: %s", self.key, exc)

    def _value(self, stopped: bool = False) -> bytes:
        now = time.time()
        record: dict = {"at": now, "address": self.address}
        if stopped:
            record["stopped"] = now
        return json.dumps(record).encode()

    async def _run(self) -> None:
        while True:
            await self.live.wait()
            try:
                await self.etcd.put(self.key, self._value())
                self.written.set()
            except errors.KvError as exc:
                log.debug("writing %s to etcd failed (retrying): %s", self.key, exc)
                await asyncio.sleep(min(self.interval_s, 1.0))
                continue
            await asyncio.sleep(self.interval_s)
