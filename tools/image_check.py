"""The image, checked by running it (tools/image_check.sh builds it first).

etcd, two agents and a router run in containers on the host network (127.0.0.1 only), then:
non-root, the three commands, the health of every container (`podman healthcheck run`: no
systemd here to run it on a timer), a store and fetch round trip from a client container
with the default /dev/shm, recovery after a stop and a start, a read-only root with a volume
(and without one: a clear message, not a traceback), and the chart's rendered commands,
config paths, ports and user against the image. Prints one line per check and ends with one
JSON line; exit 1 when any check failed.
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
RUN = f"kvc-{uuid.uuid4().hex[:6]}"  # container and volume names of this run
# No systemd here to run healthchecks on a timer: no timer, and `podman healthcheck run`
# by hand (wait_healthy).
_NOFILE = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
QUIET = (
    "--health-interval",
    "disable",
    # podman's default ulimits exceed this machine's hard limits, and runc refuses
    # them: open files up to the hard limit, processes at a modest 4096
    "--ulimit",
    f"nofile={_NOFILE}:{_NOFILE}",
    "--ulimit",
    "nproc=4096:4096",
)
AGENT_ENV = {
    "KVSTORE_AGENT_ALLOW_UNAUTHENTICATED": "true",
    "KVSTORE_AGENT_POOL_BYTES": "32MiB",
    "KVSTORE_AGENT_SLOT_BYTES": "64KiB",
    "KVSTORE_AGENT_NVME_BYTES": "256MiB",
    "KVSTORE_AGENT_METRICS_PORT": "0",
    "KVSTORE_AGENT_DEVICE": "cpu",
}

CLIENT = r"""
import sys, torch
from kvstore.client import KVClient
from kvstore.namespace import Namespace
addr, mode = sys.argv[1], sys.argv[2]
ns_spec = Namespace(tenant="acme", name="image-check", model_name="tiny", model_revision="r1",
    adapter_id="none", adapter_revision="none", tokenizer_id="tok", tokenizer_revision="r1",
    rope_type="default", rope_theta=10000.0, rope_scaling="none", attention_impl="sdpa",
    kv_dtype="float16", prompt_template_version="v1", num_layers=2, num_kv_heads=2,
    head_dim=16, tp_rank=0, tp_size=1, block_size=16)
client = KVClient(addr, tenant_secret=b"image-check-secret")
ns = client.open_namespace(ns_spec)
tokens = list(range(1000, 1000 + 8 * 16))
g = torch.Generator().manual_seed(7)
kv = torch.randn((8, 2, 2, 16, 2, 16), generator=g).to(torch.float16)  # blocks, ...
if mode == "store":
    usage = client.store(ns, tokens, [kv[i] for i in range(8)])
    print("stored", usage.cache_write_tokens)
hit = client.fetch(ns, tokens)
same = hit.cached_blocks == 8 and all(torch.equal(hit.blocks[i], kv[i]) for i in range(8))
print("fetched", hit.cached_blocks, "identical" if same else "DIFFERENT")
sys.exit(0 if same else 1)
"""


def sh(*argv: str, check: bool = False, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(argv[:4])}…: exit {r.returncode}: {r.stderr[-800:]}")
    return r


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Check:
    def __init__(self) -> None:
        self.results: dict[str, dict] = {}

    def __call__(self, name: str, ok: bool, detail: str = "") -> bool:
        self.results[name] = {"ok": bool(ok), "detail": detail[-600:]}
        print(
            f"image-check: {'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}",
            file=sys.stderr,
            flush=True,
        )
        return ok


def run_detached(image: str, name: str, args: list[str], env: dict, extra: list[str] = ()):
    envs = [a for k, v in env.items() for a in ("-e", f"{k}={v}")]
    return sh(
        "podman",
        "run",
        "-d",
        *QUIET,
        "--network",
        "host",
        "--name",
        name,
        *extra,
        *envs,
        image,
        *args,
        check=True,
    )


def wait_healthy(name: str, timeout: float = 120) -> bool:
    """`podman healthcheck run` until it passes (the image's HEALTHCHECK, kept by
    --format docker; podman's default OCI format drops it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sh("podman", "healthcheck", "run", name).returncode == 0:
            return True
        state = sh("podman", "inspect", name, "--format", "{{.State.Status}}").stdout.strip()
        if state in ("exited", "stopped"):
            return False
        time.sleep(2)
    return False


def client(image: str, addr: str, mode: str) -> subprocess.CompletedProcess:
    # Default /dev/shm (64 MiB) and its own IPC namespace: the client must notice what
    # shared memory can hold and fall back, never crash with SIGBUS.
    return sh(
        "podman",
        "run",
        "--rm",
        *QUIET,
        "--network",
        "host",
        image,
        "python",
        "-c",
        CLIENT,
        addr,
        mode,
        timeout=300,
    )


def chart_checks(check: Check, image: str) -> None:
    helm = ROOT / ".tools" / "helm"
    sh("bash", str(ROOT / "tools" / "install_helm.sh"), str(helm), check=True)
    out = sh(
        str(helm),
        "template",
        "kv",
        str(ROOT / "deploy/helm/kvstore"),
        "-f",
        str(ROOT / "deploy/helm/kvstore/ci/minimal-values.yaml"),
        check=True,
    ).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    user = sh("podman", "image", "inspect", image, "--format", "{{.Config.User}}").stdout.strip()
    exposed = sh(
        "podman", "image", "inspect", image, "--format", "{{json .Config.ExposedPorts}}"
    ).stdout
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and "agent.yaml" in d.get("data", {}))
    listen = {k: yaml.safe_load(v)["listen"] for k, v in cm["data"].items() if k.endswith(".yaml")}
    for wl in (d for d in docs if d["kind"] in ("DaemonSet", "Deployment")):
        spec = wl["spec"]["template"]["spec"]
        uid = spec.get("securityContext", {}).get("runAsUser")
        check(
            f"chart {wl['metadata']['name']}: runAsUser is the image's user",
            str(uid) == user.split(":")[0],
            f"chart {uid}, image {user}",
        )
        for c in spec["containers"]:
            cmd = c["command"]
            found = sh(
                "podman",
                "run",
                "--rm",
                *QUIET,
                "--entrypoint",
                "sh",
                image,
                "-c",
                f"command -v {cmd[0]}",
            )
            check(f"chart {c['name']}: {cmd[0]} is in the image", found.returncode == 0)
            if "--config" in cmd:
                path = cmd[cmd.index("--config") + 1]
                mounts = [m["mountPath"] for m in c.get("volumeMounts", [])]
                check(
                    f"chart {c['name']}: {path} is mounted and is where the image keeps it",
                    path in mounts
                    and sh(
                        "podman", "run", "--rm", *QUIET, "--entrypoint", "test", image, "-f", path
                    ).returncode
                    == 0,
                )
                cfg_port = int(listen[Path(path).name].rsplit(":", 1)[1])
                ports = {p["containerPort"] for p in c.get("ports", [])}
                check(
                    f"chart {c['name']}: the config's listen port is a container port",
                    cfg_port in ports and f"{cfg_port}/tcp" in exposed,
                    f"listen {cfg_port}, ports {sorted(ports)}, EXPOSE {exposed.strip()}",
                )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--image", required=True)
    ap.add_argument("--base", required=True, help="image holding a shell, for etcd")
    args = ap.parse_args()
    image, check = args.image, Check()
    names: list[str] = []
    try:
        uid = sh("podman", "run", "--rm", *QUIET, image, "id", "-u").stdout.strip()
        check("runs as a non-root user", uid not in ("", "0"), f"uid {uid}")
        for cmd in ("kvstore-agent", "kvstore-router", "kvctl"):
            r = sh("podman", "run", "--rm", *QUIET, image, cmd, "--help")
            check(f"{cmd} --help", r.returncode == 0 and "usage:" in r.stdout, r.stderr)
        etcd_port, peer_port = free_port(), free_port()
        names.append(f"{RUN}-etcd")
        run_detached(
            args.base,
            names[-1],
            [
                "etcd",
                "--data-dir",
                "/tmp/etcd",
                "--listen-client-urls",
                f"http://127.0.0.1:{etcd_port}",
                "--advertise-client-urls",
                f"http://127.0.0.1:{etcd_port}",
                "--listen-peer-urls",
                f"http://127.0.0.1:{peer_port}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{peer_port}",
                "--initial-cluster",
                f"default=http://127.0.0.1:{peer_port}",
            ],
            {},
            ["-v", "/usr/bin/etcd:/usr/local/bin/etcd:ro"],
        )
        etcd = f"127.0.0.1:{etcd_port}"
        agents = []
        for i in range(2):
            addr = f"127.0.0.1:{free_port()}"
            name = f"{RUN}-agent-{i}"
            env = {
                **AGENT_ENV,
                "KVSTORE_AGENT_NODE_ID": f"agent-{i}",
                "KVSTORE_AGENT_LISTEN": addr,
                "KVSTORE_AGENT_ETCD_ENDPOINTS": etcd,
                "KVSTORE_AGENT_DATA_DIR": f"/var/lib/kvstore/agent-{i}",
                "KVSTORE_HEALTH_ADDR": addr,
            }
            # agent-1 runs with a read-only root: only its volume is writable.
            extra = ["-v", f"{name}-data:/var/lib/kvstore"] + (["--read-only"] if i else [])
            names.append(name)
            run_detached(image, name, [], env, extra)  # the image's default command
            agents.append((name, addr, env, extra))
        router_addr = f"127.0.0.1:{free_port()}"
        names.append(f"{RUN}-router")
        run_detached(
            image,
            names[-1],
            ["kvstore-router", "--config", "/etc/kvstore/router.yaml"],
            {
                "KVSTORE_ROUTER_LISTEN": router_addr,
                "KVSTORE_ROUTER_ETCD_ENDPOINTS": etcd,
                "KVSTORE_HEALTH_ADDR": router_addr,
            },
        )
        for name, *_ in agents:
            check(
                f"{name} healthy (the image's default command and config)",
                wait_healthy(name),
                sh("podman", "logs", "--tail", "5", name).stderr,
            )
            # The image ships the UCX build for its torch: peers must not fall back to gRPC.
            logs = sh("podman", "logs", name)
            check(
                f"{name} serves peers over UCX",
                "UCX peer listener on" in logs.stdout + logs.stderr,
                "\n".join(line for line in logs.stderr.splitlines() if "UCX" in line)[-500:],
            )
        check(
            f"{RUN}-router healthy",
            wait_healthy(f"{RUN}-router"),
            sh("podman", "logs", "--tail", "5", f"{RUN}-router").stderr,
        )
        nodes = sh(
            "podman",
            "run",
            "--rm",
            *QUIET,
            "--network",
            "host",
            image,
            "kvctl",
            "nodes",
            "--etcd",
            etcd,
            "-o",
            "json",
        )
        listed = (
            sorted(n["node_id"] for n in json.loads(nodes.stdout)["nodes"])
            if nodes.returncode == 0
            else []
        )
        check(
            "both agents registered in etcd (kvctl nodes from a container)",
            listed == ["agent-0", "agent-1"],
            nodes.stderr or str(listed),
        )
        for name, addr, *_ in agents:
            r = client(image, addr, "store")
            check(
                f"store and fetch round trip against {name} from a client container",
                r.returncode == 0 and "identical" in r.stdout,
                (r.stdout + r.stderr)[-400:],
            )
        name, addr, env, extra = agents[0]
        sh("podman", "stop", "-t", "30", name, check=True)
        code = sh("podman", "inspect", name, "--format", "{{.State.ExitCode}}").stdout.strip()
        check(f"{name} exits 0 on SIGTERM", code == "0", f"exit code {code}")
        sh("podman", "start", name, check=True)
        check(f"{name} healthy again after a restart", wait_healthy(name))
        r = client(image, addr, "fetch")
        check(
            "blocks recovered after the restart (fetch only)",
            r.returncode == 0,
            (r.stdout + r.stderr)[-400:],
        )
        bare = sh(
            "podman",
            "run",
            "--rm",
            *QUIET,
            "--network",
            "host",
            "--read-only",
            *[
                a
                for k, v in {**env, "KVSTORE_AGENT_LISTEN": "127.0.0.1:0"}.items()
                for a in ("-e", f"{k}={v}")
            ],
            image,
            timeout=120,
        )
        check(
            "a read-only root without a volume: one clear line, no traceback",
            bare.returncode != 0
            and "Traceback" not in bare.stderr
            and "/var/lib/kvstore" in bare.stderr,
            bare.stderr[-400:],
        )
        chart_checks(check, image)
    except Exception as exc:  # noqa: BLE001 - reported as a failed check, then cleaned up
        check("harness", False, f"{type(exc).__name__}: {exc}")
    finally:
        for name in reversed(names):
            sh("podman", "rm", "-f", "-t", "5", name)
            sh("podman", "volume", "rm", "-f", f"{name}-data")
    failed = [k for k, v in check.results.items() if not v["ok"]]
    print(json.dumps({"image": image, "checks": len(check.results), "failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
