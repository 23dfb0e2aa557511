"""`python -m node_agent` / `kvstore-agent`: run one node agent."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from kvstore.config import AgentConfig, load_config, tls_fields


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="kvstore-agent",
        description="Run a kvstore node agent: one per GPU. Holds KV blocks in a device "
        "pool, spills to RocksDB, serves the gRPC data plane.",
        epilog="Settings come from --config, then KVSTORE_AGENT_<FIELD> environment "
        "variables, then these flags.",
    )
    p.add_argument("--config", help="YAML or JSON file with AgentConfig fields")
    p.add_argument("--node-id")
    p.add_argument("--listen", help="gRPC listen address host:port (port 0 picks a free one)")
    p.add_argument("--device", help="cuda:N, cpu or auto (default auto)")
    p.add_argument("--pool-bytes", help="device pool size, e.g. 8GiB")
    p.add_argument("--slot-bytes", help="largest block payload, e.g. 2MiB")
    p.add_argument("--data-dir", help="RocksDB directory for the NVMe tier")
    p.add_argument("--nvme-bytes", help="NVMe tier capacity, e.g. 200GiB (0 disables it)")
    p.add_argument("--eviction", choices=["value", "lru"])
    p.add_argument("--etcd-endpoints", help="etcd host:port[,host:port]")
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
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
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
    except (ValueError, OSError) as exc:
        print(f"kvstore-agent: bad configuration: {exc}", file=sys.stderr)
        return 2
    from node_agent.server import serve
    from kvstore.process import StartupError

    try:
        asyncio.run(serve(cfg, args.ready_file))
    except StartupError as exc:
        print(f"kvstore-agent: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
