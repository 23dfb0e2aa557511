"""`python -m router` / `kvstore-router`: run one router replica."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from kvstore.config import RouterConfig, load_config, read_token_file, tls_fields
from kvstore.errors import StartupError
from kvstore.process import configure_logging, log_level

TOKEN_ENV = "KVSTORE_CLUSTER_TOKEN"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="kvstore-router",
        description="Run a cache-aware router replica: discovers node agents in etcd, "
        "follows their block events into a global index and answers Route "
        "(which node should serve this prompt). Replicas are independent; each "
        "rebuilds its index from the agents.",
        epilog="Settings come from --config, then KVSTORE_ROUTER_<FIELD> environment "
        f"variables, then these flags. The cluster token (the agents' '_cluster' "
        f"tenant) comes from --cluster-token-file or ${TOKEN_ENV}.",
    )
    p.add_argument("--config", help="YAML or JSON file with RouterConfig fields")
    p.add_argument("--router-id", help="name used in logs and as the event subscriber")
    p.add_argument("--listen", help="gRPC listen address host:port (port 0 picks a free one)")
    p.add_argument("--etcd-endpoints", help="etcd host:port[,host:port]")
    p.add_argument("--etcd-prefix", default=None, help="key prefix in etcd (default /kvstore/)")
    p.add_argument(
        "--cluster-token-file", help="file holding the bearer token routers present to agents"
    )
    p.add_argument("--tls-ca", help="mTLS: CA file (tls.ca_file)")
    p.add_argument("--tls-cert", help="mTLS: this process's certificate (tls.cert_file)")
    p.add_argument("--tls-key", help="mTLS: its private key (tls.key_file)")
    p.add_argument("--ready-file", help="write the bound address here once serving")
    p.add_argument(
        "--gateway-listen",
        help="also serve the OpenAI-compatible gateway on host:port (port 0: a free one)",
    )
    p.add_argument(
        "--gateway-config",
        help="YAML or JSON file with GatewayConfig fields (router/gateway/config.py); "
        "KVSTORE_GATEWAY_<FIELD> variables override it",
    )
    p.add_argument("--gateway-ready-file", help="write the gateway's host:port here")
    p.add_argument(
        "--log-level",
        default="INFO",
        type=log_level,
        help="kvstore's own log level (libraries underneath stay at INFO); DEBUG logs "
        "every routing decision's terms (block counts only)",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_level)
    overrides = {
        "router_id": args.router_id,
        "listen": args.listen,
        "etcd_endpoints": args.etcd_endpoints,
        "tls": tls_fields(args.tls_ca, args.tls_cert, args.tls_key),
    }
    try:
        cfg = load_config(RouterConfig, args.config, "KVSTORE_ROUTER_", overrides)
        if cfg.tls.enabled:  # unreadable files: a message now, not a traceback later
            from kvstore.tls import read_files

            read_files(cfg.tls)
            if cfg.tls.for_etcd().enabled:
                read_files(cfg.tls.for_etcd())
        token = os.environ.get(TOKEN_ENV) or None
        if args.cluster_token_file:  # empty or unreadable: exit 2, never silently no token
            try:
                token = read_token_file("--cluster-token-file", args.cluster_token_file)
            except StartupError as exc:
                raise ValueError(str(exc)) from None
        from kvstore.coord.etcd import parse_endpoints

        parse_endpoints(cfg.etcd_endpoints)
        if args.etcd_prefix is not None and not args.etcd_prefix.endswith("/"):
            raise ValueError(f"--etcd-prefix must end with '/', got {args.etcd_prefix!r}")
        from router.routing import read_secret_files

        read_secret_files(cfg.tenant_secret_files)  # unreadable or empty: refused here
        gateway = None
        if args.gateway_listen or args.gateway_config:
            from router.gateway.config import GatewayConfig

            gateway = load_config(
                GatewayConfig,
                args.gateway_config,
                "KVSTORE_GATEWAY_",
                {"listen": args.gateway_listen},
            )
            if not gateway.listen:
                raise ValueError("the gateway needs --gateway-listen (or listen in its config)")
    except (ValueError, OSError) as exc:
        print(f"kvstore-router: bad configuration: {exc}", file=sys.stderr)
        return 2
    from router.server import serve

    try:
        asyncio.run(
            serve(cfg, args.ready_file, token, args.etcd_prefix, gateway, args.gateway_ready_file)
        )
    except StartupError as exc:
        print(f"kvstore-router: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
