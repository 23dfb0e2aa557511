"""`python -m kvstore.integrations.vllm_serve`: register a vLLM OpenAI server (with our
connector) in etcd for the gateway, for as long as it answers /health.

    python -m kvstore.integrations.vllm_serve --engine-id e0 --url http://10.0.0.5:8000 \\
        --node-id agent-0 --model tiny --namespace-file /tmp/e0.ns.json \\
        --etcd-endpoints 127.0.0.1:2379 -- \\
        .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --port 8000 ...

With a command after `--` it starts the engine and exits with the engine's status (and
stops the engine on SIGTERM); without one it is a sidecar of an engine started apart.
The record (kvstore/coord/engines.py) is written under a lease of `--ttl` seconds once
/health answers and the connector has written its namespace (`namespace_file` in
`kv_connector_extra_config`), and dropped (lease revoked) after `--unhealthy-after`
failed checks in a row, so a hung engine leaves as fast as a dead one. Runs in the
server venv (etcd), not in vLLM's.

An etcd serving TLS with client certificates (the cluster's `tls`): `--tls-ca`,
`--tls-cert`, `--tls-key` (the pair it presents to etcd), or `--tls-dir` (ca.crt,
client.crt, client.key: what `kvctl cluster up --tls` writes in <state>/tls). An engine
served over HTTPS (an https:// `--url`, vLLM `--ssl-*`) is checked with the same files:
its certificate must chain to that CA, and the registrar presents that pair, so an
engine requiring client certificates (`--ssl-cert-reqs 2`) answers it. One identity
and one CA per cluster, as the gateway has for its clients and engines; without TLS
files an https:// engine is checked against the system's trust store.

`--record-key-file FILE`: the engine record key, which the gateway and the router hold too
(their `engine_record_key_file`): the record is signed with it (HMAC-SHA256 over every
field, kvstore/coord/engines.py), and a gateway holding the key forwards only to engines
whose record verifies, so a record someone else wrote into etcd gets no prompt. Without
it the record is unsigned (a warning at start), and gateways with a key ignore it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import ssl
import subprocess
import sys
from pathlib import Path

import httpx

from kvstore.config import TLSConfig, read_token_file
from kvstore.coord.engines import ENGINES, EngineRecord, engine_record_key
from kvstore.coord.etcd import EtcdClient, parse_endpoints
from kvstore.coord.follow import LeasedKey
from kvstore.integrations.engine_tmp import engine_env, engine_tmpdir
from kvstore.process import StartupError, seconds
from kvstore.tls import files_in, read_files

log = logging.getLogger("kvstore.vllm_serve")


# --check-interval: 0 or less made the health loop spin at full CPU without a line of log.
interval = seconds(0.001, 3600)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, cmd = argv[:i], argv[i + 1 :]
    # The module doc's first paragraph, whole (its first line ended mid-sentence).
    summary = " ".join((__doc__ or "").split("\n\n")[0].split())
    p = argparse.ArgumentParser(prog="vllm_serve", description=summary)
    p.add_argument("--engine-id", required=True)
    p.add_argument("--url", required=True, help="the engine's HTTP base, as the gateway sees it")
    p.add_argument("--node-id", required=True, help="the agent the engine's connector uses")
    p.add_argument("--model", action="append", required=True, help="served model name (repeat)")
    p.add_argument("--namespace-file", help="where the connector writes its namespace spec")
    p.add_argument("--etcd-endpoints", default="127.0.0.1:2379")
    p.add_argument("--etcd-prefix", default=None)
    p.add_argument("--kv-events-endpoint", default=None)
    p.add_argument("--kv-events-replay-endpoint", default=None)
    p.add_argument(
        "--device",
        default="",
        help="the compute the engine runs on (e.g. cpu:HOST, cuda:GPU-UUID): engines naming "
        "the same device share it, and the router adds up their queued work",
    )
    p.add_argument("--ttl", type=int, default=5, help="lease TTL in seconds")
    p.add_argument(
        "--check-interval",
        type=interval,
        default=1.0,
        help="seconds between /health checks of the engine (default 1)",
    )
    p.add_argument("--unhealthy-after", type=int, default=2)
    p.add_argument(
        "--record-key-file",
        help="a file holding the engine record key (the gateway's and router's "
        "engine_record_key_file): the record is signed with it, and gateways holding the "
        "key ignore records that do not verify. Without it the record is unsigned (a warning "
        "at start)",
    )
    p.add_argument("--tls-ca", help="etcd's TLS: the CA its certificate chains to")
    p.add_argument("--tls-cert", help="etcd's TLS: the client certificate to present")
    p.add_argument("--tls-key", help="etcd's TLS: its private key")
    p.add_argument("--tls-dir", help="etcd's TLS: a directory with ca.crt, client.crt, client.key")
    return p.parse_args(argv), cmd


def etcd_tls(args: argparse.Namespace) -> TLSConfig | None:
    """The files to reach etcd with, read once now (ValueError naming a bad one)."""
    files = [args.tls_ca, args.tls_cert, args.tls_key]
    if args.tls_dir and any(files):
        raise ValueError("--tls-dir or --tls-ca/--tls-cert/--tls-key, not both")
    if args.tls_dir:
        tls = files_in(args.tls_dir)
    elif any(files):
        tls = TLSConfig(args.tls_ca or "", args.tls_cert or "", args.tls_key or "")
    else:
        return None
    read_files(tls)  # TLSFilesError (a ValueError) names the file
    return tls


def record_key(args: argparse.Namespace) -> bytes:
    """The engine record key from --record-key-file, b"" without one (StartupError, a
    one-line exit 2, when the file cannot be read or is empty)."""
    secret = read_token_file("--record-key-file", args.record_key_file or "")
    return engine_record_key(secret) if secret else b""


def engine_record(args: argparse.Namespace) -> EngineRecord | None:
    """The record, or None while the connector has not written its namespace yet."""
    namespace: dict = {}
    if args.namespace_file:
        path = Path(args.namespace_file)
        if not path.exists():
            return None
        namespace = json.loads(path.read_text())
    return EngineRecord(
        engine_id=args.engine_id,
        url=args.url,
        models=tuple(args.model),
        node_id=args.node_id,
        namespace=namespace,
        block_size=int(namespace.get("block_size", 0)),
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        device=args.device,
    )


def health_verify(url: str, tls: TLSConfig | None) -> ssl.SSLContext | bool:
    """What /health is checked with: for an https:// engine and TLS files, their CA and
    client pair (read by etcd_tls before, so a bad file exited 2 already)."""
    if tls is None or not url.lower().startswith("https://"):
        return True  # httpx's default: the system's trust store for https://
    ctx = ssl.create_default_context(cafile=tls.ca_file)
    ctx.load_cert_chain(tls.cert_file, tls.key_file)
    return ctx


async def _healthy(http: httpx.AsyncClient, url: str) -> bool:
    try:
        return (await http.get(url + "/health")).status_code == 200
    except httpx.HTTPError:
        return False


async def run(
    args: argparse.Namespace,
    child: subprocess.Popen | None,
    tls: TLSConfig | None = None,
    key: bytes = b"",
) -> int:
    kwargs = {"prefix": args.etcd_prefix} if args.etcd_prefix else {}
    etcd = EtcdClient(args.etcd_endpoints, tls=tls, **kwargs)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    leased: LeasedKey | None = None
    failures = 0
    unregistered_said = False  # the engine answers but has no namespace: said once
    verify = health_verify(args.url, tls)
    async with httpx.AsyncClient(timeout=max(args.check_interval, 1.0), verify=verify) as http:
        try:
            while not stop.is_set() and (child is None or child.poll() is None):
                ok = await _healthy(http, args.url.rstrip("/"))
                failures = 0 if ok else failures + 1
                rec = engine_record(args) if ok else None
                if ok and rec is None and leased is None and not unregistered_said:
                    unregistered_said = True
                    log.warning(
                        "engine %s answers /health but its connector has not written its "
                        "namespace to %s: not registered for the gateway until it does. A "
                        "refused connector says why in the engine's log ('kvstore connector "
                        "disabled'); check kv_connector_extra_config there",
                        args.engine_id,
                        args.namespace_file,
                    )
                if rec is not None and leased is None:
                    value = rec.to_json(key)  # signed with the engine record key, if given
                    leased = LeasedKey(etcd, ENGINES + rec.engine_id, value, args.ttl)
                    leased.start()
                    log.info(
                        "engine %s registered (%s, node %s)", rec.engine_id, rec.url, rec.node_id
                    )
                elif leased is not None and failures >= args.unhealthy_after:
                    await leased.stop()  # revokes the lease: the gateway drops it now
                    leased = None
                    log.warning("engine %s stopped answering /health; deregistered", args.engine_id)
                try:
                    async with asyncio.timeout(args.check_interval):
                        await stop.wait()
                except TimeoutError:
                    pass
        finally:
            if leased is not None:
                await leased.stop()
            await etcd.close()
    if child is None:
        return 0
    return _stop(child)


def _stop(child: subprocess.Popen) -> int:
    """SIGTERM the engine if it still runs, SIGKILL after 30 s; its exit status."""
    if child.poll() is None:
        child.terminate()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
    return int(child.wait())


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per /health check
    args, cmd = parse_args(argv)
    try:
        parse_endpoints(args.etcd_endpoints)
        EngineRecord(args.engine_id, args.url, tuple(args.model), args.node_id, device=args.device)
        if args.ttl < 1:
            raise ValueError("--ttl must be >= 1")
        tls = etcd_tls(args)
        key = record_key(args)
    except (ValueError, StartupError) as exc:
        print(f"vllm_serve: bad arguments: {exc}", file=sys.stderr)
        return 2
    if not key:
        log.warning(
            "engine %s: no --record-key-file, so its etcd record is unsigned: gateways "
            "holding the engine record key will not forward to it, and those without one "
            "cannot tell it from a forged record",
            args.engine_id,
        )
    if not cmd:
        return asyncio.run(run(args, None, tls, key))
    # the engine's IPC sockets and file store in a directory of its own, removed once it
    # has exited (engine_tmp.py: vLLM leaves them in /tmp when it is stopped by a signal)
    with engine_tmpdir() as tmp:
        child = subprocess.Popen(cmd, env=engine_env(tmp))
        try:
            return asyncio.run(run(args, child, tls, key))
        finally:  # run() failed: vLLM must not outlive us, nor its directory go under it
            _stop(child)


if __name__ == "__main__":
    sys.exit(main())
