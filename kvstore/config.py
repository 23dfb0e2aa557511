"""Typed configuration: one frozen dataclass per component, loadable from a YAML/JSON
file, then environment variables (KVSTORE_AGENT_<FIELD>, KVSTORE_ROUTER_<FIELD>), then
command-line overrides, in that order. Validation raises ValueError with the field name.

A nested section (AgentConfig.peer, AgentConfig.encryption) also has variables of its
own, one per field (KVSTORE_PEER_<FIELD>, the field's `env_prefix` metadata), and its
layers merge field by field: a file's `peer: {batch_bytes: 64MiB}` and
KVSTORE_PEER_IN_PLACE=0 both apply. The reading of those layers: kvstore/config_files.py.
"""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass, field


# The loaders (kvstore/config_files.py), re-exported: every component imports them here.
from kvstore.config_files import load_config as load_config, to_dict as to_dict
from kvstore.errors import StartupError
from kvstore.namespace import tenant_name_problem
from kvstore.policy import NamespacePolicy
from kvstore.units import host_problem, split_port

MiB = 1 << 20
# An agent's pool slot size (AgentConfig.slot_bytes) unless configured; kvctl plan's too.
DEFAULT_SLOT_BYTES = 2 * MiB


@dataclass(frozen=True, slots=True)
class TenantConfig:
    token_sha256: str = ""  # hex SHA-256 of the tenant's bearer token
    hbm_limit_bytes: int = 0  # 0: no limit
    nvme_limit_bytes: int = 0
    max_inflight: int = 0  # router: routed requests in flight at once; 0: router default


_SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")


def check_tenants(tenants: dict[str, TenantConfig]) -> None:
    """tenants.json (ValueError naming the first problem): names follow the namespaces'
    rule (a tenant named otherwise could never open a namespace); a token hash is 64 hex
    digits (anything else matches no token: that tenant could never authenticate), and
    no two tenants share one (a token would then authenticate as whichever came last:
    one tenant's callers acting as the other)."""
    owner: dict[str, str] = {}
    for name, t in tenants.items():
        if problem := tenant_name_problem(name):
            raise ValueError(f"tenants: the name {name!r} {problem}")
        digest = t.token_sha256
        if not digest:
            continue
        if not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest):
            raise ValueError(
                f"tenants.{name}.token_sha256 must be the 64 hex digits of the SHA-256 of "
                f"the tenant's token, got {digest!r}"
            )
        other = owner.setdefault(digest.lower(), name)
        if other != name:
            raise ValueError(
                f"tenants.{other} and tenants.{name} have the same token_sha256: one token "
                "would authenticate as both (give each tenant a token of its own)"
            )


_NET_DEVICES = re.compile(r"\^?[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*")  # UCX's list, or ^excluded


@dataclass(frozen=True, slots=True)
class PeerConfig:
    """Peer transfer tuning (node_agent/peer/). Defaults suit 2 MiB blocks on a 1-25 GB/s
    link as well as the few-KiB blocks of small models. Agents of one host must agree on
    shared_memory (else their UCX connections fail and they fall back to gRPC)."""

    # Payload bytes per chunk (blocks per chunk: batch_bytes // block size, at least 1 and
    # at most max_batch_blocks): 64 blocks of 2 MiB, 256 of 8 KiB. Sized by bytes, not
    # blocks, so that small blocks do not pay a header and a round of awaits every few KiB.
    # Large blocks: between two chunks the receiver's copies stop for a round of thread
    # hand-offs (it must read the next header before it can post the receives), while the
    # messages of one chunk (16 MiB each) are received back to back and verified as they
    # land. 64 blocks of 2 MiB on a 2-core host: 16 MiB chunks ~1.9 GB/s, 64 MiB ~2.8,
    # 128 MiB ~3.2.
    batch_bytes: int = 128 * MiB
    staging_sets: int = 3  # chunk buffers per transfer and side: >= 2 chunks in flight
    io_timeout_s: float = 10.0  # bound on any single network wait
    connect_timeout_s: float = 5.0
    prefetch_timeout_s: float = 30.0  # default bound on a whole Prefetch call
    idle_endpoint_s: float = 60.0  # a server closes a peer connection idle this long
    max_batch_blocks: int = 256  # cap on a requested batch (staging memory)
    max_transfers: int = 4  # concurrent transfers per direction (staging memory, CPU)
    # On one host, let UCX move payloads through shared memory (CMA reads, shared-memory
    # control messages) while it still detects a dead peer; False keeps them on TCP.
    shared_memory: bool = True
    # Payloads straight from B's pool slots into A's (where the pool can verify them in
    # place: host memory, or GPU memory with the device hash and a UCX built with CUDA).
    # False: through host staging copies on both sides (what a GPU pool does otherwise).
    in_place: bool = True
    # Agents of one host (same kernel and PID namespace): the fetching agent reads large
    # blocks straight from the serving agent's pool slots itself, over several threads
    # with each block hashed as it lands (node_agent/peer/ucx/direct.py; through a
    # read-only mapping of that agent's pool where it can, mapped.py), the UCX
    # connection carrying only the control messages. Needs shared_memory and in_place,
    # a host-memory pool on the fetching side, and the right to ptrace the peer (same
    # user); where the kernel refuses, that peer's payloads go back to UCX messages.
    same_host_reads: bool = True
    # The network devices UCX's transports open (UCX_NET_DEVICES; that variable in the
    # agent's environment wins). UCX's own TCP transport listens on a port of every
    # device it uses, apart from the peer listener, and what arrives there is not
    # authenticated: whoever reaches those ports can write into the agent's memory
    # (docs/tls.md, "What UCX's transports trust"). "auto": only the loopback device
    # when the agent listens on a loopback address (its peers are on this host), else
    # every device (keep them reachable by agents only: the chart's NetworkPolicy).
    # "all": every device. Else UCX's list: "eth1", "eth1,mlx5_0:1" ("^eth0": all but).
    ucx_net_devices: str = "auto"

    def __post_init__(self) -> None:
        if not _NET_DEVICES.fullmatch(self.ucx_net_devices):
            raise ValueError(
                'peer.ucx_net_devices must be "auto", "all" or UCX device names separated '
                f'by commas ("eth1,mlx5_0:1", "^eth0"), got {self.ucx_net_devices!r}'
            )
        for name in ("max_transfers", "batch_bytes", "max_batch_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"peer.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.staging_sets < 3:
            raise ValueError(
                "peer.staging_sets must be >= 3 (one being read, one on the "
                f"wire, one being written), got {self.staging_sets!r}"
            )
        for name in ("io_timeout_s", "connect_timeout_s", "prefetch_timeout_s", "idle_endpoint_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"peer.{name} must be > 0, got {getattr(self, name)!r}")

    def batch_for(self, block_bytes: int) -> int:
        """Blocks per chunk for blocks of `block_bytes`."""
        return max(1, min(self.batch_bytes // max(block_bytes, 1), self.max_batch_blocks))


@dataclass(frozen=True, slots=True)
class EncryptionConfig:
    """Encryption at rest of the NVMe tier (kvstore/tiers/sealing.py,
    docs/security-at-rest.md): AES-256-GCM under per-tenant keys read at startup from
    `keys_dir` (and again whenever its files change: rotation needs no restart), files
    `<tenant>.<key id>.key` (32 raw bytes or their base64, mode 0400 or
    0440: a file others may read refuses the start). With it on, no plaintext record is
    written; a tenant without a key keeps its blocks off NVMe; records that do not open
    (tampered, a removed key, written before encryption was on) are misses, dropped."""

    enabled: bool = False
    keys_dir: str = ""  # e.g. the mounted Secret, /etc/kvstore/at-rest
    # tenant -> key id that seals; a tenant not named here seals with its highest key id
    active: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.enabled and not self.keys_dir:
            raise ValueError("encryption.keys_dir must be set when encryption.enabled is true")
        for tenant, kid in self.active.items():
            if not 0 < kid < 1 << 32:
                raise ValueError(f"encryption.active.{tenant} must be 1..4294967295, got {kid}")


@dataclass(frozen=True, slots=True)
class TLSConfig:
    """mTLS for every hop of a process (kvstore/tls.py builds the credentials): its gRPC
    server (agent: data plane and peer; router), its gRPC channels (router -> agents, peer
    -> peer, client -> agent/router) and its etcd client (etcd's own TLS). PEM files, read
    again whenever they change on disk (a rotated Secret), so no restart is needed. All
    three of ca_file, cert_file and key_file, or none (plaintext)."""

    ca_file: str = ""  # the CA every peer's certificate must chain to (clients and servers)
    cert_file: str = ""  # this process's certificate chain (server and client use)
    key_file: str = ""
    # Servers refuse a connection without a client certificate from ca_file's CA.
    require_client_cert: bool = True
    # The name channels check the server's certificate against, instead of the host they
    # dial: agents are dialled by pod or host IP, which one certificate shared by the
    # release cannot name (the Helm chart sets the name its certificate carries). "": the
    # dialled host (a development cluster's certificates name 127.0.0.1 and localhost).
    server_name: str = ""
    # False: etcd is reached in plaintext although the gRPC hops use TLS (an etcd
    # without TLS); True: etcd's own TLS with the files below (or the ones above).
    etcd: bool = True
    # etcd's own TLS, when its CA or client pair differ (a bundled etcd with its own
    # Secret); "": the files above. Only used with etcd_endpoints and the files above set.
    etcd_ca_file: str = ""
    etcd_cert_file: str = ""
    etcd_key_file: str = ""

    def __post_init__(self) -> None:
        given = [n for n in ("ca_file", "cert_file", "key_file") if getattr(self, n)]
        if given and len(given) != 3:
            missing = sorted({"ca_file", "cert_file", "key_file"} - set(given))
            raise ValueError(f"tls: {', '.join(missing)} must be set with {', '.join(given)}")
        extra = [n for n in ("etcd_ca_file", "etcd_cert_file", "etcd_key_file") if getattr(self, n)]
        if extra and not given:
            raise ValueError(f"tls: {', '.join(extra)} need ca_file, cert_file and key_file")

    @property
    def enabled(self) -> bool:
        return bool(self.ca_file)

    def for_etcd(self) -> "TLSConfig":
        """The files the etcd client presents and trusts (off when `etcd` is False)."""
        if not self.etcd:
            return TLSConfig()
        return TLSConfig(
            self.etcd_ca_file or self.ca_file,
            self.etcd_cert_file or self.cert_file,
            self.etcd_key_file or self.key_file,
        )


def tls_fields(ca: str | None, cert: str | None, key: str | None) -> dict | None:
    """The `tls` section of a --tls-ca/--tls-cert/--tls-key override (None: none given),
    merged field by field over the file's and the environment's."""
    given = {"ca_file": ca, "cert_file": cert, "key_file": key}
    given = {k: v for k, v in given.items() if v}
    return given or None


# What a message holds beyond its payload: a block's or a request's framing and fields.
_MESSAGE_HEADROOM = 64 * 1024
# Bytes per id of the largest id list: 16 per id, and a shared-memory Get's offset each.
_BYTES_PER_ID = 32
# Block payload per gRPC message (the client's Put messages, the agent's Get responses;
# kvstore.wire.blocks_per_message).
MESSAGE_PAYLOAD_BYTES = 4 * MiB


MIN_HEALTH_CHECKS_PER_PEER = 4


def check_call_caps(cfg, *more: str) -> None:
    """The call caps an agent and a router share (and `more`): integers >= 0 (0: no cap);
    stream_idle_timeout_s > 0."""
    caps = (
        "max_calls_per_tenant",
        "max_health_watches",
        "max_health_watches_per_peer",
        "max_health_checks_per_peer",
        "max_connections",
    )
    for name in (*caps, *more):
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        if value < 0:
            raise ValueError(f"{name} must be >= 0 (0: no cap), got {value}")
    checks = cfg.max_health_checks_per_peer
    if 0 < checks < MIN_HEALTH_CHECKS_PER_PEER:
        raise ValueError(
            f"max_health_checks_per_peer must be 0 (no cap) or at least "
            f"{MIN_HEALTH_CHECKS_PER_PEER}: the kubelet's startup, liveness and readiness "
            f"probes and an operator's check can be in progress at once from one address, "
            f"got {checks}"
        )
    idle = cfg.stream_idle_timeout_s
    if not (isinstance(idle, (int, float)) and math.isfinite(idle) and idle > 0):
        raise ValueError(f"stream_idle_timeout_s must be > 0, got {idle!r}")
    for name in ("keepalive_s", "keepalive_timeout_s"):
        value = getattr(cfg, name)
        if not _seconds(value) or value < 0:
            raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
    if not _seconds(cfg.handshake_timeout_s) or cfg.handshake_timeout_s < 1:
        raise ValueError(
            f"handshake_timeout_s must be at least 1 s (a TLS handshake and HTTP/2's "
            f"preface take milliseconds), got {cfg.handshake_timeout_s!r}"
        )
    if 0 < cfg.keepalive_s < 1:
        raise ValueError(
            f"keepalive_s must be 0 (no pings) or at least 1 s (a PING on every connection "
            f"that often), got {cfg.keepalive_s!r}"
        )
    if cfg.keepalive_s > 0 and cfg.keepalive_timeout_s < 1:
        raise ValueError(
            f"keepalive_timeout_s must be at least 1 s while keepalive_s is on "
            f"({cfg.keepalive_s:g}), got {cfg.keepalive_timeout_s!r}"
        )


def _seconds(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_message_bytes(cfg: "AgentConfig") -> None:
    """max_message_bytes holds one block and one request's ids; the call caps >= 0."""
    check_call_caps(cfg, "max_concurrent_rpcs")
    # A client's Put message: up to 8 blocks and 4 MiB of them, or one larger block
    # (kvstore.wire.blocks_per_message); the agent's Get responses are no larger.
    put = max(cfg.slot_bytes, min(8 * cfg.slot_bytes, MESSAGE_PAYLOAD_BYTES))
    need = max(put, _BYTES_PER_ID * cfg.max_blocks_per_request) + _MESSAGE_HEADROOM
    if cfg.max_message_bytes < need:
        raise ValueError(
            f"max_message_bytes ({cfg.max_message_bytes}) must be at least {need}: a client's "
            f"Put message ({put} bytes of blocks at slot_bytes {cfg.slot_bytes}) or the ids "
            f"of max_blocks_per_request ({cfg.max_blocks_per_request}, {_BYTES_PER_ID} "
            f"bytes each), whichever is larger, plus {_MESSAGE_HEADROOM} bytes of headroom"
        )


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """Node agent. Sizes accept "2MiB"-style strings in files and env."""

    node_id: str = "agent-0"
    listen: str = "127.0.0.1:50051"  # gRPC listen address (port 0: pick a free one)
    advertise: str = ""  # address others dial; default: the bound listen address
    device: str = "auto"  # cuda:N, cpu, or auto
    pool_bytes: int = 256 * MiB  # device pool size (slots = pool_bytes // slot_bytes)
    slot_bytes: int = DEFAULT_SLOT_BYTES  # largest block payload this node accepts
    data_dir: str = "./kvstore-data/agent-0"  # RocksDB directory (NVMe)
    nvme_bytes: int = 4096 * MiB  # NVMe tier capacity
    # What a crash (kill -9, OOM) can lose of the NVMe tier, whose WAL is off: at most
    # this many bytes of block records (RocksDB memtables of half this size, at most two
    # unflushed) and at most what was spilled in the last nvme_flush_interval_s seconds
    # (plus the flush in progress), when the agent flushes them.
    nvme_flush_bytes: int = 64 * MiB
    nvme_flush_interval_s: float = 10.0
    eviction: str = "value"  # value | lru
    default_policy: NamespacePolicy = field(default_factory=NamespacePolicy)
    policies: dict[str, NamespacePolicy] = field(default_factory=dict)  # "tenant/name"
    # The share of the pool's slots one tenant may pin on this agent, across all its
    # namespaces (each namespace's policy pin_budget_bytes applies as well, and so does
    # the tenant's HBM quota where it is lower); 0: no tenant may pin.
    tenant_pin_fraction: float = 0.5
    tenants: dict[str, TenantConfig] = field(default_factory=dict)
    allow_unauthenticated: bool = False  # dev only: accept requests without a token
    # The largest gRPC message the agent receives or sends. The client sends Put blocks
    # and the agent its Get responses in messages of at most 4 MiB of payload (or one
    # block), so this needs one block (slot_bytes) or one request's ids, plus headroom
    # (_check_message_bytes). Calls being received hold up to this much each
    # (docs/security.md, "Memory before authentication").
    max_message_bytes: int = 8 * MiB
    # gRPC calls in progress at once on the agent's whole port, health checks included
    # (grpc.aio maximum_concurrent_rpcs; more are refused RESOURCE_EXHAUSTED, unread);
    # 0: no cap. Off by default: one counter for every caller lets one tenant's calls
    # starve the others and the liveness probe. max_calls_per_tenant caps each tenant.
    max_concurrent_rpcs: int = 0
    # Calls one tenant may have in progress on this agent at once, over gRPC and the
    # local lane (more are refused RESOURCE_EXHAUSTED, naming this key), counted from the
    # call's start, before its message has arrived; health checks, the cluster and agent
    # identities are not counted. 0: no cap.
    max_calls_per_tenant: int = 128
    # A call whose request sends no message for this long is ended (DEADLINE_EXCEEDED): a
    # unary call whose message has not arrived whole, a client stream (Put) between two
    # messages. It would hold its call, one of its tenant's, and what it sent, for ever.
    stream_idle_timeout_s: float = 30.0
    # Every gRPC connection is pinged (HTTP/2 PING) every keepalive_s; one whose client
    # does not answer within keepalive_timeout_s is closed, and its calls end. A client
    # whose host died or was cut off, or whose process is stopped, would otherwise hold
    # its calls (its tenant's share of them) and the responses queued for it until the
    # connection broke: ~15 min of retransmissions for a host that died, never for a
    # stopped process or a frozen VM. 0: no pings.
    keepalive_s: float = 60.0
    keepalive_timeout_s: float = 20.0
    # TCP connections open at once on the gRPC port (one over it is closed as it arrives,
    # until one goes; 0: no cap), and how long a connection has to finish its handshake
    # (TLS, then HTTP/2's preface) before it is closed. Before, connections that sent
    # nothing were held 30-60 s each, uncapped: 20,000 of them, no token needed, took
    # every file descriptor of the agent (gRPC stopped accepting, so did RocksDB's
    # files). Engines, peers, routers and kvctl each keep a few.
    max_connections: int = 4096
    handshake_timeout_s: float = 10.0
    # Health.Watch streams (open to anyone, never ended by the server) open at once on the
    # whole port and from one peer address (host); more are refused RESOURCE_EXHAUSTED.
    # 0: no cap.
    max_health_watches: int = 64
    max_health_watches_per_peer: int = 8
    # Health.Check calls in progress from one peer address (open to anyone; one whose
    # message arrives slowly holds up to max_message_bytes for up to
    # stream_idle_timeout_s). Per address only, so that no caller elsewhere crowds out
    # the probes (the kubelet makes one call per probe at a time). More are refused
    # RESOURCE_EXHAUSTED. 0: no cap; else at least 4 (the probes may overlap).
    max_health_checks_per_peer: int = 16
    max_blocks_per_request: int = 8192
    expire_interval_s: float = 5.0
    etcd_endpoints: str = ""  # host:port[,host:port]; empty: run without etcd
    lease_ttl_s: int = 5
    # Distinct namespaces one tenant may register, counted cluster-wide in etcd (per agent
    # while etcd is unreachable, or without etcd); 0: no limit.
    max_namespaces_per_tenant: int = 1024
    metrics_port: int = 0  # 0: no Prometheus endpoint
    peer_port: int = 0  # UCX peer-transfer listener port (0: pick a free one)
    ucx_enabled: bool = True  # False: peers move blocks over the gRPC fallback only
    metrics_host: str = ""  # Prometheus endpoint host; "": the host of `listen`
    # The Prometheus page holds every tenant's counts (hits, tokens, blocks per tenant):
    # a file holding the bearer token a scraper must present, or metrics_open: true to
    # serve it without one beyond loopback (check_metrics).
    metrics_token_file: str = ""
    metrics_open: bool = False
    otlp_endpoint: str = ""  # OTLP/gRPC traces; "": $OTEL_EXPORTER_OTLP_ENDPOINT, else off
    copy_threads: int = 0  # threads for bulk copies of a batch; 0: min(4, CPUs)
    local_lane: bool = True  # same-host clients call Lookup/Get/Put over a Unix socket
    # (and register shared memory over it: without the lane, payloads go over gRPC).
    # Who may connect: the agent's user and root (socket mode 0600), plus this group's
    # members when set (mode 0660; name or gid).
    local_lane_group: str = ""
    local_lane_max_connections: int = 80  # more are refused (RESOURCE_EXHAUSTED)
    # A connection without a shared-memory region is closed after this long without a
    # frame; a frame once begun must arrive whole within it.
    local_lane_idle_timeout_s: float = 30.0
    # Connections one tenant may hold (counted from its first frame; more are refused
    # FAILED_PRECONDITION, and clients go on over gRPC); 0: all but a fifth of
    # local_lane_max_connections (64 of 80), so no tenant can take every one and a lone
    # tenant keeps the 64 the lane had before.
    local_lane_max_connections_per_tenant: int = 0
    # A connection holding a shared-memory region is closed after this long without a
    # frame (the client registers again on its next call); >= local_lane_idle_timeout_s.
    local_lane_region_idle_timeout_s: float = 600.0
    # The largest shared-memory region (host or device staging) a client may register,
    # and the most bytes of regions one tenant may hold registered on this agent (0: no
    # cap). A host region's pages must all be allocated already (the client pays for
    # them). Past either, registration is refused FAILED_PRECONDITION and the client
    # goes on over gRPC.
    local_lane_max_region_bytes: int = 64 * 1024 * MiB
    local_lane_max_tenant_region_bytes: int = 0
    # File holding this agent's bearer token as the "_agent" identity (docs/security.md):
    # presented on pulls from registered agents (etcd nodes/); "": pulls forward the token
    # of the Prefetch's caller.
    agent_token_file: str = ""
    # Peer transfer tuning: `peer:` in the file, KVSTORE_AGENT_PEER (JSON), and one
    # KVSTORE_PEER_<FIELD> variable per field (what operators and benchmarks set).
    peer: PeerConfig = field(default_factory=PeerConfig, metadata={"env_prefix": "KVSTORE_PEER_"})
    # `encryption:` in the file, KVSTORE_ENCRYPTION_<FIELD> variables.
    encryption: EncryptionConfig = field(
        default_factory=EncryptionConfig, metadata={"env_prefix": "KVSTORE_ENCRYPTION_"}
    )
    # mTLS on the gRPC port, to peers, and to etcd; with it the UCX handshake is
    # authenticated with the same certificate (node_agent/peer/ucx/auth.py).
    tls: TLSConfig = field(default_factory=TLSConfig, metadata={"env_prefix": "KVSTORE_TLS_"})

    def __post_init__(self) -> None:
        if self.slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be > 0, got {self.slot_bytes}")
        if self.pool_bytes < self.slot_bytes:
            raise ValueError(
                f"pool_bytes ({self.pool_bytes}) must hold at least one slot of "
                f"slot_bytes ({self.slot_bytes})"
            )
        if self.eviction not in ("value", "lru"):
            raise ValueError(f"eviction must be 'value' or 'lru', got {self.eviction!r}")
        if not self.node_id or "/" in self.node_id:
            raise ValueError("node_id must be non-empty and contain no '/'")
        check_tenants(self.tenants)
        # Zero or negative here would mean a busy maintenance loop, a lease that expires at
        # once, or a server that refuses every message.
        for name in (
            "max_blocks_per_request",
            "max_message_bytes",
            "expire_interval_s",
            "lease_ttl_s",
            "local_lane_max_connections",
            "local_lane_idle_timeout_s",
            "stream_idle_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.nvme_bytes < 0:
            raise ValueError(f"nvme_bytes must be >= 0, got {self.nvme_bytes}")
        _check_message_bytes(self)
        check_listen("listen", self.listen)
        for name in ("metrics_port", "peer_port"):
            _check_port(name, getattr(self, name))
        _distinct_ports(self, "metrics_port", "peer_port")
        check_metrics(self)
        _check_lane_limits(self)
        if not _DEVICE.fullmatch(self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.max_namespaces_per_tenant < 0:
            raise ValueError(
                f"max_namespaces_per_tenant must be >= 0 (0: no limit), got "
                f"{self.max_namespaces_per_tenant!r}"
            )
        if not (
            isinstance(self.tenant_pin_fraction, int | float)
            and not isinstance(self.tenant_pin_fraction, bool)
            and 0 <= self.tenant_pin_fraction <= 1
        ):
            raise ValueError(
                "tenant_pin_fraction must be a number from 0 to 1 (the share of the pool "
                f"one tenant may pin), got {self.tenant_pin_fraction!r}"
            )
        if self.nvme_flush_bytes < MiB:
            raise ValueError(
                f"nvme_flush_bytes must be >= 1MiB (two RocksDB memtables of "
                f"half of it), got {self.nvme_flush_bytes}"
            )
        if not 0 < self.nvme_flush_interval_s <= 3600:
            raise ValueError(
                f"nvme_flush_interval_s must be > 0 and <= 3600, got {self.nvme_flush_interval_s!r}"
            )

    @property
    def pool_slots(self) -> int:
        return self.pool_bytes // self.slot_bytes

    @property
    def tenant_pin_bytes(self) -> int:
        """What one tenant may pin on this agent across its namespaces: whole slots,
        tenant_pin_fraction of the pool's (a pinned block is charged a slot)."""
        return math.floor(self.pool_slots * self.tenant_pin_fraction) * self.slot_bytes

    def policy_for(self, tenant: str, name: str) -> NamespacePolicy:
        return self.policies.get(f"{tenant}/{name}", self.default_policy)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    router_id: str = "router-0"
    listen: str = "127.0.0.1:50050"
    etcd_endpoints: str = "127.0.0.1:2379"
    weight_recompute: float = 1.0  # cost of one block nobody holds
    weight_peer_fetch: float = 1.0  # x the measured time of a peer pull (router/scoring.py)
    weight_load: float = 4.0  # per in-flight request on a node
    weight_utilization: float = 2.0  # per unit of pool utilization
    weight_queue: float = 1.0  # per block of prefill queued on a node (in-flight routes)
    prefill_tokens_per_s: float = 8000.0  # recompute speed, to price peer fetches
    peer_gbps: float = 1.0  # expected peer transfer bandwidth
    inflight_timeout_s: float = 120.0  # forget a routed request never released
    metrics_port: int = 0
    metrics_host: str = ""  # Prometheus endpoint host; "": the host of `listen`
    metrics_token_file: str = ""  # as the agent's (the page has every tenant's counts)
    metrics_open: bool = False
    otlp_endpoint: str = ""  # OTLP/gRPC traces; "": $OTEL_EXPORTER_OTLP_ENDPOINT, else off
    # Callers authenticate as the agents' tenants do (bearer token, SHA-256 listed here; the
    # same tenants.json the agents load). "_cluster" (routers, agents, kvctl) may list node
    # addresses and override weights; a tenant routes and releases its own requests only.
    tenants: dict[str, TenantConfig] = field(default_factory=dict)
    allow_unauthenticated: bool = False  # dev only: callers without a token act as the cluster
    # Routed requests in flight per tenant (TenantConfig.max_inflight overrides); 0: no cap
    max_inflight_per_tenant: int = 1024
    # gRPC calls one tenant may have in progress on this router at once, counted from the
    # call's start, before its message has arrived (more are refused RESOURCE_EXHAUSTED,
    # naming this key); the cluster identity, development callers and health checks are
    # not counted. 0: no cap. Each call being received holds up to 4 MiB (gRPC's default
    # largest message).
    max_calls_per_tenant: int = 128
    # A call whose message has not arrived whole this long after it started is ended
    # (DEADLINE_EXCEEDED), its call given back to its tenant.
    stream_idle_timeout_s: float = 30.0
    # Connections pinged and closed when their client does not answer, as the agent's.
    keepalive_s: float = 60.0
    keepalive_timeout_s: float = 20.0
    # TCP connections open at once on the gRPC port and the time each has to finish its
    # handshake, as the agent's (0: no cap). The gateway's are `gateway.max_connections`.
    max_connections: int = 4096
    handshake_timeout_s: float = 10.0
    # Health.Watch streams open at once, on the whole port and from one peer address
    # (host), and Health.Check calls in progress from one address, as the agent's. 0: no
    # cap.
    max_health_watches: int = 64
    max_health_watches_per_peer: int = 8
    max_health_checks_per_peer: int = 16
    # What a tenant's routes may queue as prefill work (blocks; 0: no cap), one request
    # and all of its requests on one node: a Route's block ids are the caller's word, and
    # queued work steers every tenant's routes away from a node. Work beyond is not
    # counted (the request is still routed). 8192 blocks: a 128k-token prompt at 16
    # tokens per block; 16384: two of them, ~33 s of prefill at 8000 tokens/s.
    max_route_work_blocks: int = 8192
    max_queued_blocks_per_tenant: int = 16384
    # Serving engines' own caches (router/engines.py, from their vLLM KV events): a file
    # per tenant holding its chain-root secret (the connector's tenant_secret_file), so
    # the router can name an engine's blocks by kvstore chain ids; an engine whose tenant
    # is not listed is routed by load and agents only.
    tenant_secret_files: dict[str, str] = field(default_factory=dict)
    engine_local_price: float = 0.05  # a block loaded from the node's agent vs recomputed
    # A file holding the engine record key, the one the engines' registrars sign their
    # etcd records with (vllm_serve --record-key-file; docs/security.md, Engine records):
    # the gateway forwards to, and the KV-event subscriber follows, only records that
    # verify. "": every record is taken as it stands (a warning once a gateway starts or
    # a record appears).
    engine_record_key_file: str = ""
    # With the key, what of a record that carries no signature at all: "refuse" (it is
    # treated as absent) or "accept" (taken, logged once per etcd key and counted: while
    # registrars are being given the key, e.g. the first step of a chart upgrade). A
    # record whose signature does not verify is refused either way.
    engine_record_unsigned: str = "refuse"
    # mTLS on the router's port, to the agents' event streams and to etcd.
    tls: TLSConfig = field(default_factory=TLSConfig, metadata={"env_prefix": "KVSTORE_TLS_"})

    def __post_init__(self) -> None:
        if self.engine_record_unsigned not in ("refuse", "accept"):
            raise ValueError(
                "engine_record_unsigned must be refuse or accept, got "
                f"{self.engine_record_unsigned!r}"
            )
        if not 0 <= self.engine_local_price < 1:
            raise ValueError("engine_local_price must be in [0, 1)")
        if self.max_inflight_per_tenant < 0:
            raise ValueError("max_inflight_per_tenant must be >= 0")
        check_call_caps(self)
        for name in ("max_route_work_blocks", "max_queued_blocks_per_tenant"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: no cap)")
        check_tenants(self.tenants)
        for name, t in self.tenants.items():
            if t.max_inflight < 0:
                raise ValueError(f"tenants.{name}.max_inflight must be >= 0")
        for name in (
            "weight_recompute",
            "weight_peer_fetch",
            "weight_load",
            "weight_utilization",
            "weight_queue",
        ):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not self.prefill_tokens_per_s > 0 or not self.peer_gbps > 0:
            raise ValueError("prefill_tokens_per_s and peer_gbps must be > 0")
        if not (math.isfinite(self.inflight_timeout_s) and self.inflight_timeout_s > 0):
            # 0 forgot every routed request at once: no load was ever counted
            raise ValueError(
                "inflight_timeout_s must be a number of seconds > 0, "
                f"got {self.inflight_timeout_s!r}"
            )
        check_listen("listen", self.listen)
        _check_port("metrics_port", self.metrics_port)
        _distinct_ports(self, "metrics_port")
        check_metrics(self)


def read_token_file(field: str, path: str) -> str:
    """The token in the file `path` names (`field`: the setting that names it, for the
    message); '' when no file is configured. StartupError when the file cannot be read or
    is empty: a credential meant to be used is never silently missing."""
    if not path:
        return ""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise StartupError(f"{field} {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not token:
        raise StartupError(f"{field} {path} is empty")
    return token


def metrics_bind_host(metrics_host: str, listen: str) -> str:
    """The metrics host: the configured one, else the host the gRPC server listens on (so
    a pod listening on 0.0.0.0 is scrapeable and a dev agent on 127.0.0.1 stays local)."""
    if metrics_host:
        return metrics_host
    host = listen.rsplit(":", 1)[0].strip("[]") if ":" in listen else ""
    return host or "127.0.0.1"


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve anywhere
        return False


def check_metrics(cfg) -> None:
    """A Prometheus page beyond loopback needs a token (metrics_token_file) or an explicit
    metrics_open: its per-tenant series (requests, hits, tokens, blocks, each tenant
    labelled) tell whoever reaches the port what every tenant does, which Stats and
    Route withhold from tenants."""
    if not cfg.metrics_port or cfg.metrics_token_file or cfg.metrics_open:
        return
    host = metrics_bind_host(cfg.metrics_host, cfg.listen)
    if not _loopback(host):
        raise ValueError(
            f"metrics_port {cfg.metrics_port} on {host} would show every tenant's counts to "
            "whoever reaches it: set metrics_token_file (a file holding the bearer token "
            "Prometheus presents), a loopback metrics_host, or metrics_open: true (served "
            "without a token; limit who reaches the port)"
        )


_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")


def _distinct_ports(cfg, *names: str) -> None:
    """The listen port and these port fields name different ports (0s aside): the second
    to bind failed as if another process held the port, or a UCX listener went down."""
    listen = split_port(cfg.listen)  # checked already (check_listen)
    ports = {"listen": listen[1] if listen else 0} | {n: getattr(cfg, n) for n in names}
    taken: dict[int, str] = {}
    for name, port in ports.items():
        if port and port in taken:
            raise ValueError(
                f"{taken[port]} and {name} both name port {port}: each needs a port of its own"
            )
        taken[port] = name


def _check_port(name: str, port: int) -> None:
    if not 0 <= port <= 65535:
        raise ValueError(f"{name} must be in 0..65535 (0: none, or a free one), got {port}")


def _check_lane_limits(cfg: AgentConfig) -> None:
    """The local lane's per-tenant caps and its region limits (ValueError naming them)."""
    per_tenant = cfg.local_lane_max_connections_per_tenant
    if not 0 <= per_tenant <= cfg.local_lane_max_connections:
        raise ValueError(
            "local_lane_max_connections_per_tenant must be from 0 (all but a fifth of "
            f"local_lane_max_connections) to local_lane_max_connections "
            f"({cfg.local_lane_max_connections}), got {per_tenant!r}"
        )
    if not cfg.local_lane_region_idle_timeout_s >= cfg.local_lane_idle_timeout_s:
        raise ValueError(
            "local_lane_region_idle_timeout_s must be >= local_lane_idle_timeout_s "
            f"({cfg.local_lane_idle_timeout_s!r}), got {cfg.local_lane_region_idle_timeout_s!r}"
        )
    if cfg.local_lane_max_region_bytes <= 0:
        raise ValueError(
            f"local_lane_max_region_bytes must be > 0, got {cfg.local_lane_max_region_bytes!r}"
        )
    tenant_cap = cfg.local_lane_max_tenant_region_bytes
    if tenant_cap and tenant_cap < cfg.local_lane_max_region_bytes:
        raise ValueError(
            "local_lane_max_tenant_region_bytes must be 0 (no cap) or >= "
            f"local_lane_max_region_bytes ({cfg.local_lane_max_region_bytes}), got "
            f"{cfg.local_lane_max_tenant_region_bytes!r}"
        )


def check_listen(name: str, address: str) -> None:
    """host:port with a port in 0..65535 (0: a free one); gRPC binds 99999 as 34463."""
    parts = split_port(address)
    if parts is None or parts[1] > 65535:
        raise ValueError(f"{name} must be host:port with a port in 0..65535, got {address!r}")
    if problem := host_problem(parts[0]):
        raise ValueError(f"{name}: {problem}")
