#!/usr/bin/env python3
"""gRPC health check for the container image (Docker HEALTHCHECK, or an exec probe on
clusters without native gRPC probes). Kubernetes >= 1.24 should use the native `grpc:`
probe on the same port instead; this speaks the same grpc.health.v1 protocol.

Exit status: 0 when the service reports SERVING, 1 when it reports anything else,
2 when it cannot be reached in time.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvstore-health", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "address",
        nargs="?",
        default=os.environ.get("KVSTORE_HEALTH_ADDR", "127.0.0.1:50051"),
        help="host:port of the gRPC server (env KVSTORE_HEALTH_ADDR)",
    )
    p.add_argument("--service", default="", help='health service name ("" is the whole server)')
    p.add_argument("--timeout", type=float, default=3.0, help="seconds")
    # mTLS (the Helm chart's tls.*): the kubelet's native gRPC probe cannot present these.
    p.add_argument("--tls-ca", help="CA file: the server must present a certificate of it")
    p.add_argument("--tls-cert", help="client certificate to present")
    p.add_argument("--tls-key", help="its private key")
    p.add_argument("--tls-server-name", help="name to check the server's certificate against")
    return p.parse_args(argv)


def _channel(args) -> grpc.Channel:
    if not args.tls_ca:
        return grpc.insecure_channel(args.address)

    def read(path):
        with open(path, "rb") as f:
            return f.read()

    creds = grpc.ssl_channel_credentials(
        read(args.tls_ca),
        read(args.tls_key) if args.tls_key else None,
        read(args.tls_cert) if args.tls_cert else None,
    )
    opts = [("grpc.ssl_target_name_override", args.tls_server_name)] if args.tls_server_name else []
    return grpc.secure_channel(args.address, creds, options=opts)


def check(args) -> int:
    address, service, timeout = args.address, args.service, args.timeout
    try:
        channel = _channel(args)
    except OSError as exc:
        print(f"kvstore-health: cannot read a TLS file: {exc}", file=sys.stderr)
        return 2
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            print(f"kvstore-health: {address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 2
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(f"kvstore-health: {address} service={service!r}: {status}")
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    return check(args)


if __name__ == "__main__":
    sys.exit(main())
