"""`python -m node_agent` / `kvstore-agent`: run one node agent."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from kvstore.config import AgentConfig, load_config, tls_fields
from kvstore.process import configure_logging, log_level
from kvstore.units import format_size


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="kvstore-agent",
        description="Run a kvstore node agent: one per GPU. Holds KV blocks in a device "
        "pool, spills to RocksDB, serves the gRPC data plane.",
        epilog="Settings come from --config, then KVSTORE_AGENT_<FIELD> environment "
        "variables, then these flags.",
    )
    d = AgentConfig()  # the defaults, as the help states them
    p.add_argument("--config", help="YAML or JSON file with AgentConfig fields")
    p.add_argument("--node-id", help=f"this agent's name in the cluster (default {d.node_id})")
    p.add_argument(
        "--listen",
        help=f"gRPC listen address host:port (port 0 picks a free one; default {d.listen})",
    )
    p.add_argument("--device", help=f"cuda:N, cpu or auto (default {d.device})")
    p.add_argument(
        "--pool-bytes", help=f"device pool size, e.g. 8GiB (default {format_size(d.pool_bytes)})"
    )
    p.add_argument(
        "--slot-bytes",
        help=f"largest block payload, e.g. 2MiB (default {format_size(d.slot_bytes)})",
    )
    p.add_argument(
        "--data-dir",
        help=f"RocksDB directory for the NVMe tier (default {d.data_dir}, under the "
        "directory the agent starts in)",
    )
    p.add_argument(
        "--nvme-bytes",
        help=f"NVMe tier capacity, e.g. 200GiB; 0 disables it "
        f"(default {format_size(d.nvme_bytes)})",
    )
    p.add_argument(
        "--eviction",
        choices=["value", "lru"],
        help=f"which blocks leave a full tier first (default {d.eviction})",
    )
    p.add_argument(
        "--etcd-endpoints", help="etcd host:port[,host:port] (default none: run without etcd)"
    )
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        default=None,
        help="accept requests without a tenant token (development only)",
    )
    p.add_argument("--tls-ca", help="mTLS: CA file (tls.ca_file)")
    p.add_argument("--tls-cert", help="mTLS: this process's certificate (tls.cert_file)")
    p.add_argument("--tls-key", help="mTLS: its private key (tls.key_file)")
    p.add_argument("--ready-file", help="write the bound address here once serving")
    p.add_argument(
        "--log-level",
        default="INFO",
        type=log_level,
        help="kvstore's own log level (libraries underneath stay at INFO)",
    )
    return p.parse_args(argv)


def host_memory_bytes() -> int:
    """This host's memory, or the lowest cgroup v2 limit above this process when lower
    (a container's, a systemd slice's); cgroup v1 limits are not read."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        own = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return total
    rel = next((line[3:] for line in own if line.startswith("0::")), None)
    if rel is None:
        return total
    d = Path("/sys/fs/cgroup") / rel.strip().lstrip("/")
    for c in (d, *d.parents):
        try:
            limit = (c / "memory.max").read_text().strip()
        except OSError:
            limit = ""
        if limit.isascii() and limit.isdigit():
            total = min(total, int(limit))
        if c == Path("/sys/fs/cgroup"):
            break
    return total


def check_device_and_memory(cfg: AgentConfig) -> None:
    """ValueError for a device this host does not have, or a host pool larger than its
    memory: found at start, as a message, not a traceback or the kernel's OOM killer
    (which picks its victims among every process of the host) once the pool is touched."""
    from kvstore.tiers.pool import resolve_device

    try:
        device = resolve_device(cfg.device)
    except RuntimeError as exc:  # torch's own, for a string it does not parse
        raise ValueError(f"device {cfg.device!r}: {exc}") from None
    if device.type == "cpu" and cfg.pool_bytes > (memory := host_memory_bytes()):
        raise ValueError(
            f"pool_bytes ({format_size(cfg.pool_bytes)}) is more than this host's memory "
            f"({format_size(memory)})"
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_level)
    overrides = {
        k: getattr(args, k)
        for k in (
            "node_id",
            "listen",
            "device",
            "pool_bytes",
            "slot_bytes",
            "data_dir",
            "nvme_bytes",
            "eviction",
            "etcd_endpoints",
            "allow_unauthenticated",
        )
    }
    overrides["tls"] = tls_fields(args.tls_ca, args.tls_cert, args.tls_key)
    try:
        cfg = load_config(AgentConfig, args.config, "KVSTORE_AGENT_", overrides)
        if cfg.tls.enabled:  # unreadable files: a message now, not a traceback later
            from kvstore.tls import read_files

            read_files(cfg.tls)
            if cfg.tls.for_etcd().enabled:
                read_files(cfg.tls.for_etcd())
        if cfg.etcd_endpoints:
            from kvstore.coord.etcd import parse_endpoints

            parse_endpoints(cfg.etcd_endpoints)
        check_device_and_memory(cfg)
    except (ValueError, OSError) as exc:
        print(f"kvstore-agent: bad configuration: {exc}", file=sys.stderr)
        return 2
    from node_agent.server import serve
    from kvstore.heap import keep_message_buffers
    from kvstore.process import StartupError

    # Messages and their copies (protobuf, gRPC's slices) reused from the heap, not mapped
    # and faulted in afresh each: gRPC Gets ran at half speed without it.
    keep_message_buffers(2 * cfg.max_message_bytes)

    try:
        asyncio.run(serve(cfg, args.ready_file))
    except StartupError as exc:
        print(f"kvstore-agent: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
