"""Which token a pull presents to the peer it reads from (docs/security.md, Identities).

An agent configured with the agent credential (`agent_token_file`, the `_agent` identity)
proves it is an agent to the peers it pulls from, which then serve any namespace (the
caller's access was checked here, before the pull). That credential goes only to an
address that a registered agent publishes in etcd (`nodes/`, followed here), never to one
a caller merely named in its Prefetch: there the caller's own token is forwarded, so the
pull can read no more than the caller could, and a listener of an attacker's choosing
learns nothing it did not already hold."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from kvstore.coord.etcd import NODES, EtcdClient, KeyValue, NodeRecord, WatchEvent
from kvstore.process import StartupError
from node_agent.peer.transport import PeerRef

log = logging.getLogger("kvstore.agent.peer")


def read_token(path: str) -> str:
    """The agent token in `path` ('' when no file is configured)."""
    if not path:
        return ""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as exc:
        raise StartupError(f"agent_token_file {path}: {exc.strerror or exc}") from None
    if not token:
        raise StartupError(f"agent_token_file {path} is empty")
    return token


class PeerCredential:
    """The authorization a pull sends: the agent's own for registered agents' addresses,
    the caller's otherwise (and always, without an agent token or without etcd)."""

    def __init__(self, agent_token: str) -> None:
        self._auth = f"Bearer {agent_token}" if agent_token else ""
        self._members: dict[str, tuple[str, str]] = {}  # node id -> (gRPC, UCX) address
        self._addresses: frozenset[str] = frozenset()
        self._task: asyncio.Task | None = None
        self._etcd: EtcdClient | None = None

    def start(self, etcd_endpoints: str) -> None:
        """Follow the registered agents in etcd (nothing to follow without a token, and
        without etcd every pull forwards the caller's token)."""
        if self._auth and etcd_endpoints:
            self._etcd = EtcdClient(etcd_endpoints)
            self._task = asyncio.create_task(self._etcd.follow(NODES, self._reset, self._apply))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._etcd is not None:
            await self._etcd.close()
            self._etcd = None

    def for_pull(self, peer: PeerRef, caller_auth: str) -> str:
        named = {a for a in (peer.grpc_address, peer.ucx_address) if a}
        if self._auth and named and named <= self._addresses:
            return self._auth
        return caller_auth

    def _reset(self, items: list[KeyValue]) -> None:
        self._members = {}
        for kv in items:
            self._set(kv.key, kv.value)
        self._refresh()

    def _apply(self, events: list[WatchEvent]) -> None:
        for ev in events:
            if ev.deleted:
                self._members.pop(ev.key[len(NODES) :], None)
            else:
                self._set(ev.key, ev.value)
        self._refresh()

    def _set(self, key: str, value: bytes) -> None:
        try:
            rec = NodeRecord.from_json(value)
        except (ValueError, TypeError) as exc:  # not an agent we can trust an address of
            log.warning("ignoring node record %s: %s", key, exc)
            return
        self._members[rec.node_id] = (rec.address, rec.peer_address)

    def _refresh(self) -> None:
        self._addresses = frozenset(a for pair in self._members.values() for a in pair if a)
