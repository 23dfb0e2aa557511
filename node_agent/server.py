"""Node agent process: builds the store from config, recovers it from RocksDB, serves gRPC
(data plane, events, health) and runs background maintenance."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvstore.auth import RESERVED_TENANTS
from kvstore.process import StartupError, bind_port, run_until_signalled
from kvstore.accounting import TenantAccounts
from kvstore.auth import TokenTable
from kvstore.config import AgentConfig
from kvstore.eviction import make_policy
from kvstore.pullcost import PullCost
from kvstore.events import Tier
from kvstore.store import BlockStore
from kvstore.units import format_size
from kvstore.tiers.pool import DevicePool
from kvstore.tiers.rocks import (
    Quarantine,
    RocksTier,
    TierCorrupt,
    TierInUse,
    TierUnavailable,
    lock_held_elsewhere,
    quarantine,
)
from kvstore.tiers.sealing import KeyFileError, Sealer
from kvstore.grpc_edge import WatchGate, check_gate, connection_options, keepalive_options
from kvstore.v1 import agent_pb2_grpc
from kvstore.v1 import peer_pb2_grpc
from node_agent.events import EventHub
from node_agent.interceptors import EdgeInterceptor
from node_agent.local_lane import LaneLimits, LocalLane, lane_gid
from node_agent.metrics import AgentTelemetry
from node_agent.peer.service import PeerTransfer
from node_agent.peer.ucx import direct
from node_agent.servicer import AgentServicer
from node_agent.shm import ShmLimits, ShmRegistry

if TYPE_CHECKING:  # imported when etcd_endpoints is set (they bring the etcd client)
    from node_agent.control import AgentControl
    from kvstore.coord.seen import SeenWriter
    from node_agent.registration import Registration

log = logging.getLogger("kvstore.agent")
SHUTDOWN_PERSIST_S = 10.0  # bound on the pool -> NVMe copy at a clean stop
KEY_CHECK_S = 1.0  # how often the at-rest key directory is checked for changes
NVME_PROBE_S = 0.5  # how often an NVMe write outage's back-off is checked for its end
REGISTER_WAIT_S = 10.0  # start() waits this long for the first etcd registration


def load_sealer(cfg: AgentConfig) -> Sealer | None:
    """The NVMe tier's encryption (cfg.encryption), or None when it is off. A key file
    that cannot be used stops the start: running on without it would write plaintext or
    turn a tenant's whole NVMe tier into misses."""
    enc = cfg.encryption
    if not enc.enabled:
        return None
    try:
        sealer = Sealer.from_directory(enc.keys_dir, enc.active)
    except KeyFileError as exc:
        raise StartupError(f"encryption at rest: {exc}") from None
    keyrings = sealer.keyrings
    log.info(
        "NVMe tier encrypted (AES-256-GCM): keys for %d tenants (%s), active ids %s",
        len(keyrings),
        ", ".join(sorted(keyrings)),
        {t: r.active for t, r in sorted(keyrings.items())},
    )
    return sealer


def open_nvme(cfg: AgentConfig) -> RocksTier | None:
    """The NVMe tier, or None when it is off. Unreadable RocksDB files are quarantined
    and the tier starts empty; a disk too full to even open RocksDB runs the agent
    without the tier (a restart once there is space brings it back)."""
    if not cfg.nvme_bytes:
        return None
    sealer = load_sealer(cfg)
    if os.path.exists(cfg.data_dir) and not os.path.isdir(cfg.data_dir):
        raise StartupError(
            f"data_dir {cfg.data_dir} is a file, not a directory: point data_dir at a "
            "directory (it is created if missing), or set nvme_bytes: 0 to run without "
            "the NVMe tier"
        )
    try:
        os.makedirs(cfg.data_dir, exist_ok=True)
    except OSError as exc:  # e.g. a read-only root filesystem with no volume mounted
        raise StartupError(
            f"data_dir {cfg.data_dir} cannot be created ({exc.strerror}): mount a writable "
            "volume there (in a container: a volume on /var/lib/kvstore), or set "
            "nvme_bytes: 0 to run without the NVMe tier"
        ) from exc
    in_use = (
        f"data_dir {cfg.data_dir} is in use by another process (another agent?): its "
        "RocksDB LOCK is held; give each agent a data_dir of its own"
    )
    if lock_held_elsewhere(cfg.data_dir):
        raise StartupError(in_use)
    warn_if_larger_than_disk(cfg)
    try:
        return RocksTier(cfg.data_dir, cfg.nvme_bytes, cfg.nvme_flush_bytes, sealer=sealer)
    except TierInUse as exc:  # taken meanwhile; not damage: its files stay where they are
        raise StartupError(in_use) from exc
    except TierCorrupt as exc:
        return quarantine_nvme(cfg, str(exc), sealer)
    except TierUnavailable as exc:
        log.error("NVMe tier off for this run: %s", exc)
        return None


def warn_if_larger_than_disk(cfg: AgentConfig) -> None:
    """nvme_bytes larger than data_dir's whole filesystem: the tier would never evict,
    it would fill the disk and spills would fail there. Worth one line, not a refusal
    (a volume may grow)."""
    try:
        fs_bytes = shutil.disk_usage(cfg.data_dir).total
    except OSError:
        return
    if cfg.nvme_bytes > fs_bytes:
        log.warning(
            "nvme_bytes (%s) is more than the whole filesystem of data_dir %s (%s): the "
            "NVMe tier fills the disk before it evicts, and spills then fail; lower "
            "nvme_bytes below the free space or grow the volume",
            format_size(cfg.nvme_bytes),
            cfg.data_dir,
            format_size(fs_bytes),
        )


def quarantine_nvme(cfg: AgentConfig, reason: str, sealer: Sealer | None) -> RocksTier:
    """Move the unreadable files aside (kvstore.tiers.rocks.quarantine) and open an empty
    tier in their place: an agent that starts beats a crash loop over a damaged disk.
    Files that cannot be moved stop the start with one line saying why."""
    try:
        moved_to = quarantine(cfg.data_dir)
    except OSError as exc:
        where = exc.filename if exc.filename2 is None else f"{exc.filename} -> {exc.filename2}"
        raise StartupError(
            f"NVMe tier unreadable ({reason}) and its files cannot be moved aside "
            f"({exc.strerror}: {where}): "
            f"make {cfg.data_dir} writable or move its files away by hand, or set "
            "nvme_bytes: 0 to run without the NVMe tier"
        ) from exc
    log.error(
        "NVMe tier unreadable (%s): moved its files to %s, starting with an empty NVMe tier",
        reason,
        moved_to,
    )
    rocks = RocksTier(cfg.data_dir, cfg.nvme_bytes, cfg.nvme_flush_bytes, sealer=sealer)
    rocks.quarantined = Quarantine(moved_to, reason)
    return rocks


def build_store(cfg: AgentConfig) -> BlockStore:
    # A host pool other agents of this host may map read-only (peer/ucx/mapped.py): only
    # where they would read it directly anyway, and it exposes nothing new
    shareable = (
        cfg.ucx_enabled
        and cfg.peer.same_host_reads
        and cfg.peer.shared_memory
        and direct.pool_may_be_mapped()
    )
    pool = DevicePool(cfg.pool_slots, cfg.slot_bytes, cfg.device, shareable=shareable)
    rocks = open_nvme(cfg)
    limits = {  # the reserved identities (routers, peer agents) hold no blocks
        t: {Tier.HBM: tc.hbm_limit_bytes, Tier.NVME: tc.nvme_limit_bytes}
        for t, tc in cfg.tenants.items()
        if t not in RESERVED_TENANTS
    }
    threads = cfg.copy_threads or min(4, os.cpu_count() or 1)
    store = BlockStore(
        pool,
        rocks,
        make_policy(cfg.eviction),
        TenantAccounts(limits),
        policy_for=lambda ns: cfg.policy_for(ns.tenant, ns.name),
        copy_threads=threads,
        tenant_pin_bytes=cfg.tenant_pin_bytes,
    )
    return store


class AgentServer:
    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.store = build_store(cfg)
        self.hub = EventHub(self.store, cfg.node_id)
        self.shm = ShmRegistry(
            ShmLimits(cfg.local_lane_max_region_bytes, cfg.local_lane_max_tenant_region_bytes)
        )
        self.servicer = AgentServicer(
            self.store,
            self.hub,
            self.shm,
            cfg.node_id,
            cfg.max_blocks_per_request,
            cfg.max_namespaces_per_tenant,
        )
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self._tasks: list[asyncio.Task] = []
        self.registration: Registration | None = None  # etcd membership, with etcd_endpoints
        self.seen: SeenWriter | None = None  # seen/agent/<id> while registered
        # etcd generations, quotas, kill switch (node_agent/control.py)
        self.control: AgentControl | None = None
        self.peer = PeerTransfer(self.store, cfg, self.hub.publish_pending)  # node_agent/peer/
        self.telemetry: AgentTelemetry | None = None  # Prometheus, tracing (node_agent/metrics.py)
        self.lane: LocalLane | None = None  # same-host Unix-socket lane (cfg.local_lane)

    @property
    def address(self) -> str:
        if self.cfg.advertise:
            return self.cfg.advertise
        host = self.cfg.listen.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    @property
    def peer_address(self) -> str:
        """host:port of the UCX peer-transfer listener; '' when UCX is off/unavailable."""
        return self.peer.peer_address

    async def start(self) -> None:
        if self.cfg.local_lane:  # a host setting, read before recovery (minutes, at worst)
            lane_gid(self.cfg.local_lane_group)
        self.telemetry = AgentTelemetry(self)
        rec = self._recover()
        log.info(
            "recovered %d blocks from %s (%d dropped)",
            rec["recovered"],
            self.cfg.data_dir,
            rec["dropped"],
        )
        if self.cfg.etcd_endpoints:  # catch up (flushes, kill switch) before serving
            from node_agent.control import AgentControl

            self.control = AgentControl(
                self.store,
                self.cfg.etcd_endpoints,
                self.cfg.node_id,
                self.hub.publish_pending,
                max_namespaces_per_tenant=self.cfg.max_namespaces_per_tenant,
                tls=self.cfg.tls,
            )
            self.telemetry.watch_generations(self.control)
            await self.control.start()
            self.servicer.control = self.control
        opts = [
            ("grpc.max_send_message_length", self.cfg.max_message_bytes),
            ("grpc.max_receive_message_length", self.cfg.max_message_bytes),
            ("grpc.so_reuseport", 0),
            *keepalive_options(self.cfg.keepalive_s, self.cfg.keepalive_timeout_s),
            *connection_options(self.cfg.max_connections, self.cfg.handshake_timeout_s),
        ]
        tokens = {t: tc.token_sha256 for t, tc in self.cfg.tenants.items()}
        interceptors = [
            *self.telemetry.interceptors,
            EdgeInterceptor(
                tokens,
                self.cfg.allow_unauthenticated,
                self.cfg.max_calls_per_tenant,
                self.cfg.stream_idle_timeout_s,
                WatchGate(self.cfg.max_health_watches, self.cfg.max_health_watches_per_peer),
                check_gate(self.cfg.max_health_checks_per_peer),
            ),
        ]
        self.server = grpc.aio.server(
            interceptors=interceptors,
            options=opts,
            maximum_concurrent_rpcs=self.cfg.max_concurrent_rpcs or None,
        )
        agent_pb2_grpc.add_NodeAgentServicer_to_server(self.servicer, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        peer_pb2_grpc.add_PeerServicer_to_server(self.peer.servicer, self.server)
        self.port = bind_port(self.server, self.cfg.listen, self.cfg.tls)
        if self.cfg.etcd_endpoints and self.control is not None:
            # A member of an etcd cluster: no hit before its first registration (the
            # registration's fence takes over below; kvstore/coord/fence.py). A flush that
            # commits before our record exists does not wait for us.
            self.store.fence = _always
        await self.server.start()
        if self.cfg.local_lane:  # the same interceptors: one auth, metrics and error path
            limits = LaneLimits(
                self.cfg.local_lane_group,
                self.cfg.local_lane_max_connections,
                self.cfg.local_lane_idle_timeout_s,
                self.cfg.local_lane_max_connections_per_tenant,
                self.cfg.local_lane_region_idle_timeout_s,
            )
            self.lane = LocalLane(
                self.servicer,
                interceptors,
                TokenTable(tokens, self.cfg.allow_unauthenticated),
                limits,
            )
            await self.lane.start()
            self.servicer.lane = self.lane
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set("kvstore.v1.NodeAgent", health_pb2.HealthCheckResponse.SERVING)
        await self.peer.start(self.address.rsplit(":", 1)[0], self.control)
        await self.health.set("kvstore.v1.Peer", health_pb2.HealthCheckResponse.SERVING)
        self._tasks.append(asyncio.create_task(self._maintenance()))
        if self.store.rocks is not None:
            self._tasks.append(asyncio.create_task(self._flush_nvme()))
            self._tasks.append(asyncio.create_task(self._probe_nvme()))
            if self.store.rocks.sealer is not None:
                self._tasks.append(asyncio.create_task(self._watch_keys(self.store.rocks.sealer)))
        if self.cfg.etcd_endpoints and self.control is not None:  # control: started above
            from node_agent.registration import Registration

            # After each (re-)registration, list generations again: a flush that read
            # membership before our key existed did not wait for us (kvstore/coord/follow.py).
            self.registration = Registration(
                self.cfg.etcd_endpoints,
                self.node_record,
                self.cfg.lease_ttl_s,
                on_registered=self.control.catch_up,
                tls=self.cfg.tls,
            )
            # Hits only while the lease is surely alive (kvstore/coord/fence.py): every
            # lookup, get and peer read asks, from the first registration on.
            self.store.fence = self.registration.fence.fenced
            await self.registration.start()
            try:  # ready once registered (a duplicate node id waits: fenced, all misses)
                async with asyncio.timeout(REGISTER_WAIT_S):
                    await self.registration.registered.wait()
            except TimeoutError:
                log.warning(
                    "agent %s is not registered in etcd yet: every lookup misses until it is",
                    self.cfg.node_id,
                )
            from kvstore.coord.seen import SeenWriter

            # seen/agent/<id>, lease-less: `kvctl status` names this agent as missing
            # once its lease is gone, or as stopped after a clean stop (`stop` marks it;
            # kvstore/coord/seen.py).
            self.seen = SeenWriter(
                self.control.etcd,
                "agent",
                self.cfg.node_id,
                self.registration.registered,
                self.address,
            )
            self.seen.start()
        log.info(
            "agent %s serving on %s (device %s, %d slots of %d bytes)",
            self.cfg.node_id,
            self.address,
            self.store.pool.device,
            self.store.pool.n_slots,
            self.store.pool.slot_bytes,
        )

    def _recover(self) -> dict[str, int]:
        """Index what RocksDB holds; a record it cannot read quarantines the tier (the
        store is left unchanged by the failed scan, so it recovers the empty one)."""
        try:
            return self.store.recover()
        except TierCorrupt as exc:  # raised by a scan: the tier exists
            sealer = None
            if self.store.rocks is not None:
                sealer = self.store.rocks.sealer
                self.store.rocks.close()
            self.store.rocks = quarantine_nvme(self.cfg, str(exc), sealer)
            return self.store.recover()

    async def _flush_nvme(self) -> None:
        """Bound what a crash loses (the WAL is off): flush every nvme_flush_interval_s,
        off the event loop. close() waits for a flush in progress."""
        rocks = self.store.rocks  # set for good once start() recovered it
        assert rocks is not None, "started only with an NVMe tier"
        while True:
            await asyncio.sleep(self.cfg.nvme_flush_interval_s)
            await asyncio.to_thread(rocks.flush)

    async def _probe_nvme(self) -> None:
        """End an NVMe write outage once RocksDB writes again (space came back), even
        with no spill to find out: health and `kvctl nodes` clear on an idle agent too.
        Off the event loop; RocksTier.probe tries only once each back-off is over."""
        rocks = self.store.rocks
        assert rocks is not None, "started only with an NVMe tier"
        while True:
            await asyncio.sleep(NVME_PROBE_S)
            if rocks.health.due():
                await asyncio.to_thread(rocks.probe)

    async def _watch_keys(self, sealer: Sealer) -> None:
        """Take changed at-rest key files into use without a restart (a rotation's new
        key, a retired one): a few stat calls a second, off the event loop."""
        while True:
            await asyncio.sleep(KEY_CHECK_S)
            await asyncio.to_thread(sealer.refresh)

    async def _maintenance(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.expire_interval_s)
            n = self.store.expire()
            if n:
                log.info("expired %d blocks", n)
            self.hub.publish_pending()

    def node_record(self):
        """This agent as etcd publishes it (node_agent/registration.py)."""
        from kvstore.coord.etcd import NodeRecord

        pool = self.store.pool
        with self.store.lock:
            blocks = self.store.block_count()
        record = NodeRecord(
            self.cfg.node_id,
            self.address,
            self.peer_address,
            str(pool.device),
            pool.capacity_bytes,
            self.store.rocks.capacity_bytes if self.store.rocks is not None else 0,
            round(1.0 - pool.free_slots / pool.n_slots, 2),
            blocks,
            self.hub.epoch,
            *_pull_fields(self.peer.pull_cost()),
        )
        return self.peer.sign(record)

    async def stop(self, grace: float = 1.0) -> None:
        if self.seen is not None:
            await self.seen.stop()
        if self.registration is not None:  # leave the cluster before we stop serving
            # Misses from here: once our lease is revoked a flush no longer waits for us,
            # and our watch of the generations ends too.
            self.store.fence = _always
            await self.registration.stop()
        if self.control is not None:
            await self.control.stop()
        for t in self._tasks:
            t.cancel()
        if self.lane is not None:
            self.servicer.lane = None
            await self.lane.stop()
        if self.server is not None:
            await self.health.enter_graceful_shutdown()
            await self.server.stop(grace)
        await self.peer.stop()
        self.shm.close()
        if self.store.rocks is not None:
            # Pool contents die with the process; write chain heads to NVMe so the tails
            # already there are not dropped as orphans when the agent comes back.
            n = self.store.persist_pool(deadline_s=SHUTDOWN_PERSIST_S)
            log.info("wrote %d pool blocks to NVMe before stopping", n)
            self.store.rocks.close()
        if self.telemetry is not None:
            self.telemetry.close()
        log.info("agent %s stopped", self.cfg.node_id)


async def serve(cfg: AgentConfig, ready_file: str | None = None) -> None:
    await run_until_signalled(AgentServer(cfg), ready_file)


def _pull_fields(cost: PullCost | None) -> tuple[float, float, int]:
    """(pull_fixed_ms, pull_ms_per_mib, pull_samples) for the node record, to 3
    significant digits: the record is rewritten in etcd only when it changes, so the
    noise of every pull must not rewrite it on every heartbeat."""
    if cost is None:
        return 0.0, 0.0, 0
    return (
        float(f"{cost.fixed_s * 1e3:.3g}"),
        float(f"{cost.s_per_byte * 1e3 * (1 << 20):.3g}"),
        cost.samples,
    )


def _always() -> bool:
    """The store's fence while the agent is not (or no longer) a registered member."""
    return True
