"""Which token a pull presents to the peer it reads from (docs/security.md, Identities).

An agent configured with the agent credential (`agent_token_file`, the `_agent` identity)
proves it is an agent to the peers it pulls from, which then serve any namespace (the
caller's access was checked here, before the pull). That credential goes only to an
address that a registered agent publishes in etcd (`nodes/`, followed here), never to one
a caller merely named in its Prefetch: there the caller's own token is forwarded, so the
pull can read no more than the caller could, and a listener of an attacker's choosing
learns nothing it did not already hold.

etcd alone cannot say which records agents wrote: anyone with etcd write access (a client
certificate of the cluster's CA, a pod past the NetworkPolicy) can put `nodes/evil`
naming a listener of theirs. So each agent signs its record (`signature`: HMAC-SHA256
over its node id and every address it names, keyed by a hash of the agent token), and
only records that verify under this agent's own token, stored under their own node id,
lend their addresses the agent credential. A forged record, one copying a real agent's
signature onto another address, and one from an agent without the token are followed
like any unknown address: the caller's token goes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

from kvstore.config import TLSConfig
from kvstore.coord import records
from kvstore.coord.etcd import NODES, EtcdClient, KeyValue, NodeRecord, WatchEvent
from node_agent.peer.transport import PeerRef

log = logging.getLogger("kvstore.agent.peer")


# Domain separation: the record key is neither the token nor its SHA-256, which
# tenants.json holds (routers and agents read it), so knowing the hash signs nothing.
RECORD_CONTEXT = "kvstore node record v1"


def record_key(agent_token: str) -> bytes:
    """The key agents sign their node records with: SHA-256(context + token)."""
    return records.record_key(RECORD_CONTEXT, agent_token)


def record_signature(key: bytes, rec: NodeRecord) -> str:
    """HMAC-SHA256 (hex) over what decides trust: the node id and both addresses, as one
    JSON array (unambiguous: no field can run into the next; kvstore/coord/records.py)."""
    return records.record_hmac(key, RECORD_CONTEXT, rec.node_id, rec.address, rec.peer_address)


def record_verifies(key: bytes, rec: NodeRecord) -> bool:
    """Whether `rec`, as it stands, was signed by an agent holding the token that `key`
    comes from (a signature that is not an ASCII string, as a forger may write, is not)."""
    if not key:
        return False
    try:
        expected = record_signature(key, rec)
    except ValueError:  # a field JSON cannot carry
        return False
    return records.signature_matches(rec.signature, expected)


class PeerCredential:
    """The authorization a pull sends: the agent's own for registered agents' addresses,
    the caller's otherwise (and always, without an agent token or without etcd)."""

    def __init__(self, agent_token: str) -> None:
        self._auth = f"Bearer {agent_token}" if agent_token else ""
        self._key = record_key(agent_token) if agent_token else b""
        # node id -> (gRPC, UCX) address, of the records whose signature verifies
        self._members: dict[str, tuple[str, str]] = {}
        self._refused: set[str] = set()  # node ids already logged as not trusted
        self._addresses: frozenset[str] = frozenset()
        self._task: asyncio.Task | None = None
        self._etcd: EtcdClient | None = None

    def sign(self, rec: NodeRecord) -> NodeRecord:
        """`rec` with this agent's signature (unsigned without an agent token)."""
        if not self._key:
            return rec
        return dataclasses.replace(rec, signature=record_signature(self._key, rec))

    def start(self, etcd_endpoints: str, tls: TLSConfig | None = None) -> None:
        """Follow the registered agents in etcd, over `tls` like the agent's other etcd
        clients (nothing to follow without a token, and without etcd every pull forwards
        the caller's token)."""
        if self._auth and etcd_endpoints:
            self._etcd = EtcdClient(etcd_endpoints, tls=tls)
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
        self._refused = set()
        for kv in items:
            self._set(kv.key, kv.value)
        self._refresh()

    def _apply(self, events: list[WatchEvent]) -> None:
        for ev in events:
            if ev.deleted:
                node = ev.key[len(NODES) :]
                self._members.pop(node, None)
                self._refused.discard(node)
            else:
                self._set(ev.key, ev.value)
        self._refresh()

    def _set(self, key: str, value: bytes) -> None:
        """Trust the record under `key` (replacing what that key held) if an agent holding
        our token signed it for this node id and these addresses."""
        node = key[len(NODES) :]
        self._members.pop(node, None)
        try:
            rec = NodeRecord.from_json(value)
        except (ValueError, TypeError) as exc:  # not an agent we can trust an address of
            log.warning("ignoring node record %s: %s", key, exc)
            return
        if rec.node_id == node and record_verifies(self._key, rec):
            self._members[node] = (rec.address, rec.peer_address)
            self._refused.discard(node)
        elif node not in self._refused:  # once per record, not at each rewrite
            self._refused.add(node)
            log.warning(
                "node record %s is not signed with this agent's agent token: pulls from "
                "%s forward the caller's token, not the agent credential",
                key,
                ", ".join(a for a in (rec.address, rec.peer_address) if a),
            )

    def _refresh(self) -> None:
        self._addresses = frozenset(a for pair in self._members.values() for a in pair if a)
