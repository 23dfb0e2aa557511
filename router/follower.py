"""Feeds RouterCore: membership from etcd, block events from every agent.

- etcd nodes/ (list then watch): a new key starts an event stream to that agent, a deleted
  key (clean shutdown or lease expiry) stops it and drops the node from the index.
- One Subscribe stream per agent: a snapshot (every event carries the snapshot's sequence
  number S), then live events with contiguous sequence numbers from S+1. On a gap, an
  epoch change (the agent restarted), a NAMESPACE_CLEARED event (the stream does not say
  which blocks went) or any stream error, the node is resynced from a fresh snapshot.
- etcd namespaces/ gives namespace layouts (block bytes and tokens) for peer pricing;
  etcd killswitch turns every route into a pure load decision.
"""

from __future__ import annotations

import asyncio
import json
import logging

import grpc

from kvstore.coord.etcd import (
    NAMESPACES,
    NODES,
    KILLSWITCH,
    EtcdClient,
    KeyValue,
    NodeRecord,
    WatchEvent,
    killswitch_enabled,
)
from kvstore.config import TLSConfig
from kvstore.tls import aio_channel
from kvstore.namespace import Namespace
from kvstore.v1 import agent_pb2, agent_pb2_grpc
from router.access import NamespaceOwners
from router.routing import RouterCore

log = logging.getLogger("kvstore.router")

_MAX_MESSAGE = 64 << 20
_RETRY_S = (0.2, 3.0)


class Resync(Exception):
    """The node's stream can no longer be applied incrementally."""


class NodeStream:
    """Follows one agent's event stream into the index until cancelled."""

    def __init__(
        self,
        core: RouterCore,
        node_id: str,
        address: str,
        subscriber: str,
        token: str | None,
        tls: TLSConfig | None = None,
    ) -> None:
        self.core = core
        self.tls = tls
        self.node_id = node_id
        self.address = address
        self.subscriber = subscriber
        self._md = (("authorization", f"Bearer {token}"),) if token else ()
        self.task = asyncio.create_task(self._run(), name=f"events-{node_id}")

    def cancel(self) -> None:
        self.task.cancel()

    async def _run(self) -> None:
        delay = _RETRY_S[0]
        while True:
            try:
                async with aio_channel(
                    self.address, self.tls, [("grpc.max_receive_message_length", _MAX_MESSAGE)]
                ) as channel:
                    await self._follow(agent_pb2_grpc.NodeAgentStub(channel))
            except Resync as exc:
                log.info("node %s: %s; resyncing from a fresh snapshot", self.node_id, exc)
                delay = _RETRY_S[0]
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    "node %s event stream at %s failed: %s %s",
                    self.node_id,
                    self.address,
                    exc.code().name,
                    exc.details(),
                )
            except (ValueError, TypeError) as exc:  # a malformed event: start over
                log.error(
                    "node %s sent an event the index cannot apply (%s); resyncing",
                    self.node_id,
                    exc,
                )
            self.core.mark_unsynced(self.node_id)
            await asyncio.sleep(delay)
            delay = min(delay * 2, _RETRY_S[1])

    async def _follow(self, stub) -> None:
        call = stub.Subscribe(
            agent_pb2.SubscribeRequest(subscriber=self.subscriber), metadata=self._md
        )
        epoch = None
        expected = None  # next live sequence number; None: accept the first one
        try:
            async for batch in call:
                if epoch is None:
                    if not batch.snapshot:
                        raise Resync("stream did not start with a snapshot")
                    epoch = batch.epoch
                    self.core.begin_snapshot(self.node_id, epoch)
                elif batch.epoch != epoch:
                    raise Resync(f"epoch changed mid-stream ({epoch[:8]} -> {batch.epoch[:8]})")
                if batch.snapshot:
                    for ev in batch.events:
                        self._apply(ev)
                        expected = ev.seq + 1
                    if batch.snapshot_done:
                        self.core.mark_synced(self.node_id)
                        log.info(
                            "node %s synced: %d blocks",
                            self.node_id,
                            self.core.index.node_blocks(self.node_id)[0],
                        )
                    continue
                for ev in batch.events:
                    if expected is not None and ev.seq != expected:
                        raise Resync(f"sequence gap: expected {expected}, got {ev.seq}")
                    expected = ev.seq + 1
                    self._apply(ev)
            raise Resync("the agent closed the stream")
        finally:
            call.cancel()

    def _apply(self, ev: agent_pb2.Event) -> None:
        # Packed ids go to the index as they came (it validates them: a length that is
        # not a multiple of 16 is a ValueError, and the stream resyncs).
        index = self.core.index
        if ev.kind == agent_pb2.Event.STORED:
            index.store(self.node_id, ev.block_ids, ev.tier or 1)
        elif ev.kind == agent_pb2.Event.REMOVED:
            index.remove(self.node_id, ev.block_ids)
        elif ev.kind == agent_pb2.Event.TIER_CHANGED:
            index.set_tier(self.node_id, ev.block_ids, ev.tier)
        elif ev.kind == agent_pb2.Event.NAMESPACE_CLEARED:
            raise Resync(
                f"namespace {ev.namespace_id.hex()[:12]} cleared to generation {ev.generation}"
            )


class ClusterFollower:
    """Runs the etcd follows and the per-node streams for one RouterCore."""

    def __init__(
        self,
        core: RouterCore,
        etcd: EtcdClient,
        router_id: str,
        token: str | None = None,
        owners: NamespaceOwners | None = None,
        tls: TLSConfig | None = None,
    ) -> None:
        """`owners`: fed each namespace's tenant (router/access.py checks Routes with it);
        `tls`: the event streams run over mTLS with these files."""
        self.tls = tls
        self.core = core
        self.owners = owners or NamespaceOwners()
        self.etcd = etcd
        self.router_id = router_id
        self.token = token
        self.streams: dict[str, NodeStream] = {}
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        for prefix, reset, apply in (
            (NODES, self._reset_nodes, self._apply_nodes),
            (NAMESPACES, self._reset_namespaces, self._apply_namespaces),
            (KILLSWITCH, self._reset_killswitch, self._apply_killswitch),
        ):
            self._tasks.append(
                asyncio.create_task(self.etcd.follow(prefix, reset, apply), name=f"etcd-{prefix}")
            )

    async def stop(self) -> None:
        tasks = self._tasks + [s.task for s in self.streams.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self.streams.clear()

    # ------------------------------------------------------------------- nodes
    def _reset_nodes(self, items: list[KeyValue]) -> None:
        seen = set()
        for kv in items:
            rec = self._record(kv.key, kv.value)
            if rec is not None:
                seen.add(rec.node_id)
                self._upsert(rec)
        for node_id in list(self.core.nodes):
            if node_id not in seen:
                self._remove(node_id)

    def _apply_nodes(self, events: list[WatchEvent]) -> None:
        for ev in events:
            node_id = ev.key[len(NODES) :]
            if ev.deleted:
                self._remove(node_id)
            else:
                rec = self._record(ev.key, ev.value)
                if rec is not None:
                    self._upsert(rec)

    @staticmethod
    def _record(key: str, value: bytes) -> NodeRecord | None:
        try:
            rec = NodeRecord.from_json(value)
        except (ValueError, TypeError) as exc:
            log.warning("ignoring malformed etcd record %s: %s", key, exc)
            return None
        if key[len(NODES) :] != rec.node_id:
            log.warning("ignoring etcd record %s: it names node %r", key, rec.node_id)
            return None
        return rec

    def _upsert(self, rec: NodeRecord) -> None:
        if self.core.upsert_node(rec) or rec.node_id not in self.streams:
            old = self.streams.pop(rec.node_id, None)
            if old is not None:
                old.cancel()
            log.info("node %s joined at %s (%s)", rec.node_id, rec.address, rec.device)
            self.streams[rec.node_id] = NodeStream(
                self.core, rec.node_id, rec.address, self.router_id, self.token, self.tls
            )

    def _remove(self, node_id: str) -> None:
        stream = self.streams.pop(node_id, None)
        if stream is not None:
            stream.cancel()
        self.core.remove_node(node_id)

    # -------------------------------------------------------------- namespaces
    def _reset_namespaces(self, items: list[KeyValue]) -> None:
        for kv in items:
            self._namespace(kv.key, kv.value)

    def _apply_namespaces(self, events: list[WatchEvent]) -> None:
        for ev in events:
            if ev.deleted:
                try:
                    ns_id = bytes.fromhex(ev.key.rsplit("/", 1)[-1])
                except ValueError:
                    continue
                self.core.forget_namespace(ns_id)
                self.owners.forget(ns_id)
            else:
                self._namespace(ev.key, ev.value)

    def _namespace(self, key: str, value: bytes) -> None:
        try:
            record = json.loads(value)
            spec = Namespace.from_dict(record["spec"])
            generation = int(record.get("generation", 0))
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring etcd namespace record %s: %s", key, exc)
            return
        self.core.set_namespace_layout(spec.namespace_id, spec.block_bytes, spec.block_size)
        # Engines' cached blocks are named under the generation in force (router/engines.py).
        self.core.set_generation(spec.namespace_id, generation)
        # The key names the tenant and the id too; a record that disagrees with its own
        # spec grants no tenant access (the id is the spec's hash, tenant included).
        if key[len(NAMESPACES) :] != f"{spec.tenant}/{spec.namespace_id.hex()}":
            log.warning(
                "etcd namespace record %s holds the spec of %s/%s: no tenant may route it",
                key,
                spec.tenant,
                spec.namespace_id.hex(),
            )
            return
        self.owners.set(spec.namespace_id, spec.tenant, spec.public)

    # -------------------------------------------------------------- killswitch
    def _reset_killswitch(self, items: list[KeyValue]) -> None:
        raw = next((kv.value for kv in items if kv.key == KILLSWITCH), b"")
        self._set_killswitch(killswitch_enabled(raw))

    def _apply_killswitch(self, events: list[WatchEvent]) -> None:
        for ev in events:
            if ev.key == KILLSWITCH:
                self._set_killswitch(not ev.deleted and killswitch_enabled(ev.value))

    def _set_killswitch(self, on: bool) -> None:
        if on != self.core.killswitch:
            log.warning(
                "kill switch %s: routing %s",
                "ON" if on else "off",
                "by load only" if on else "by cache again",
            )
        self.core.killswitch = on
