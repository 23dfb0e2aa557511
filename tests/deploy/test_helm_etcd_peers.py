"""The bundled etcd's members talk to each other over mutual TLS when the release runs
TLS (tls.enabled, tls.etcd): every key replicates over the peer port, which used to stay
plaintext. The members are run here for real: the rendered StatefulSet's arguments, with
its names and ports moved to 127.0.0.1 and its Secret to a test CA, against the etcd
binary the suite uses (3.4, from Debian; the chart's image is 3.5). An upgrade keeps
members made with http:// peer URLs as they are (etcd keeps those URLs in its data: the
flag alone changing would cut the members off from each other); the chart README's steps
(one member at a time, with the StatefulSet's partition) move them to TLS and back with
every key kept, where a free rollout of every member loses etcd's quorum."""

from __future__ import annotations

import base64
import json
import shutil
import socket
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from kvstore.devprocs import client_context, etcd_healthy

from tests.deploy.test_helm import (  # noqa: F401 - helm is a fixture
    CHART,
    NAMESPACE,
    chart_as_upgrade,
    helm,
    one,
    render,
    render_error,
    run_helm,
)
from tests.support.common import _stop_proc, free_port, wait_for

TLS = (
    "tls.enabled=true",
    "tls.certManager.enabled=true",
    "tls.certManager.issuerRef.name=cluster-ca",
)
VALUES = "production-values.yaml"  # three members
PEER_TLS_FLAGS = (
    "--peer-cert-file=",
    "--peer-key-file=",
    "--peer-trusted-ca-file=",
    "--peer-client-cert-auth",
)


def etcd_args(docs: list[dict]) -> list[str]:
    return one(docs, "StatefulSet", "-etcd")["spec"]["template"]["spec"]["containers"][0]["args"]


def peer_scheme(args: list[str]) -> str:
    listen = next(a for a in args if a.startswith("--listen-peer-urls="))
    return listen.split("=", 1)[1].split("://")[0]


def test_tls_releases_run_their_etcd_peers_on_mutual_tls(helm):  # noqa: F811
    args = etcd_args(render(helm, VALUES, *TLS))
    assert peer_scheme(args) == "https"
    for flag in PEER_TLS_FLAGS:
        assert any(a.startswith(flag) for a in args), flag
    cluster = next(a for a in args if a.startswith("--initial-cluster="))
    members = cluster.split("=", 1)[1].split(",")
    assert len(members) == 3 and all("=https://" in m for m in members)
    assert any(a.startswith("--initial-advertise-peer-urls=https://") for a in args)
    # the same pair as the client port: the Certificate must serve both ends of a peer link
    cert = one(render(helm, VALUES, *TLS), "Certificate", "-tls")["spec"]
    assert {"server auth", "client auth"} <= set(cert["usages"])
    # Said otherwise, or without TLS on etcd, the peers stay plaintext and get no TLS flag
    for sets in (
        (*TLS, "tls.etcdPeers=plaintext"),
        (*TLS, "tls.etcd=false"),
        ("tls.enabled=false",),
    ):
        args = etcd_args(render(helm, VALUES, *sets))
        assert peer_scheme(args) == "http", sets
        assert not [a for a in args if a.startswith("--peer-")], sets
        cluster = next(a for a in args if a.startswith("--initial-cluster="))
        assert "https://" not in cluster, sets


PVC_LOOKUP = '(lookup "v1" "PersistentVolumeClaim" .Release.Namespace (printf "data-%s-0" $name))'


def _upgrade_chart(tmp_path: Path, live: dict | None, volume: bool = False) -> Path:
    """A copy of the chart whose lookup of the running etcd StatefulSet answers `live`
    (None: there is none) and that of its first member's data volume finds one when
    `volume`, with NOTES rendered into a ConfigMap of its own: `helm template` reaches
    no cluster."""

    def answer(text: str) -> str:
        lookup = next(ln for ln in text.splitlines() if "lookup" in ln and "StatefulSet" in ln)
        literal = json.dumps(json.dumps(live or {}))
        text = text.replace(lookup, "{{- $live := fromJson " + literal + " -}}")
        assert text.count(PVC_LOOKUP) == 1
        pvc = {"kind": "PersistentVolumeClaim"} if volume else {}
        return text.replace(PVC_LOOKUP, "(fromJson " + json.dumps(json.dumps(pvc)) + ")")

    return chart_as_upgrade(tmp_path, answer)


def _upgrade_argv(*sets: str) -> list[str]:
    argv = ["--is-upgrade", "-f", str(CHART / "ci" / VALUES)]
    for s in sets:
        argv += ["--set", s]
    return argv


def _upgrade(
    helm,  # noqa: F811
    tmp_path: Path,
    live: dict | None,
    *sets: str,
    volume: bool = False,
) -> tuple[list[str], str]:
    """(etcd's args, NOTES) as `helm upgrade` renders them over a running release whose
    etcd StatefulSet is `live` (None: there is none; `volume`: its data volume is there)."""
    chart, argv = _upgrade_chart(tmp_path, live, volume), _upgrade_argv(*sets)
    out = {}
    for show in ("etcd.yaml", "zz-notes.yaml"):
        proc = run_helm(helm, "template", *argv, "--show-only", f"templates/{show}", chart=chart)
        assert proc.returncode == 0, proc.stderr
        out[show] = [d for d in yaml.safe_load_all(proc.stdout) if d]
    return etcd_args(out["etcd.yaml"]), out["zz-notes.yaml"][0]["data"]["notes"]


def _upgrade_error(
    helm,  # noqa: F811
    tmp_path: Path,
    live: dict | None,
    *sets: str,
    volume: bool = False,
) -> str:
    chart = _upgrade_chart(tmp_path, live, volume)
    proc = run_helm(helm, "template", *_upgrade_argv(*sets), chart=chart)
    assert proc.returncode != 0, f"helm accepted {sets} over {live}"
    return proc.stderr


def _sts(args: list[str]) -> dict:
    return {"spec": {"template": {"spec": {"containers": [{"args": args}]}}}}


def test_turning_tls_off_never_cuts_tls_peers_off_unannounced(helm, tmp_path):  # noqa: F811
    on_tls = _sts(etcd_args(render(helm, VALUES, *TLS)))
    for off in ("tls.enabled=false", "tls.etcd=false"):
        err = _upgrade_error(helm, tmp_path, on_tls, *TLS, off)
        assert "tls.etcdPeers=plaintext" in err and "Upgrading: etcd peers to TLS" in err, err
        # said so: plaintext peers, and the README's steps in reverse
        args, _ = _upgrade(helm, tmp_path, on_tls, *TLS, off, "tls.etcdPeers=plaintext")
        assert peer_scheme(args) == "http" and not [a for a in args if a.startswith("--peer-")]
    # TLS between members asked for without TLS on etcd: refused with the reason
    err = _upgrade_error(helm, tmp_path, None, *TLS, "tls.etcd=false", "tls.etcdPeers=tls")
    assert "tls.etcdPeers is tls" in err and "tls.etcd true" in err, err
    # and for an external etcd, whose members are not the chart's
    for said in ("tls", "plaintext"):
        err = render_error(helm, "external-etcd-values.yaml", *TLS, f"tls.etcdPeers={said}")
        assert "applies to the bundled etcd's members only" in err, err


def test_an_upgrade_keeps_plaintext_peers_until_told(helm, tmp_path):  # noqa: F811
    plain = _sts(etcd_args(render(helm, VALUES, *TLS, "tls.etcdPeers=plaintext")))
    # members made with http:// peer URLs (an earlier chart): kept, and NOTES says how to move
    args, notes = _upgrade(helm, tmp_path, plain, *TLS)
    assert peer_scheme(args) == "http"
    assert "Upgrading: etcd" in notes and "tls.etcdPeers=tls" in notes
    # the operator's word moves them (the README's steps), and nothing is noted then
    args, notes = _upgrade(helm, tmp_path, plain, *TLS, "tls.etcdPeers=tls")
    assert peer_scheme(args) == "https" and "etcdPeers" not in notes
    # once moved, the next upgrade with the value empty keeps TLS
    moved = _sts(args)
    args, notes = _upgrade(helm, tmp_path, moved, *TLS)
    assert peer_scheme(args) == "https" and "etcdPeers" not in notes
    # an upgrade that finds no StatefulSet (etcd was external before): as an install
    args, _ = _upgrade(helm, tmp_path, None, *TLS)
    assert peer_scheme(args) == "https"
    # a reinstall that kept the data volumes: what they recorded is unknown, so the
    # chart asks instead of guessing (either guess could cut the members off)
    err = _upgrade_error(helm, tmp_path, None, *TLS, volume=True)
    assert "data volumes" in err and "Set tls.etcdPeers" in err, err
    for said, scheme in (("plaintext", "http"), ("tls", "https")):
        args, _ = _upgrade(helm, tmp_path, None, *TLS, f"tls.etcdPeers={said}", volume=True)
        assert peer_scheme(args) == scheme


# ---- the rendered members, run ------------------------------------------------------


@dataclass
class Member:
    name: str
    client: int = field(default_factory=free_port)
    peer: int = field(default_factory=free_port)
    metrics: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    serves_tls: bool = True  # its client port serves TLS (as started last)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client}"


class Members:
    """The chart's etcd members as processes on 127.0.0.1."""

    def __init__(self, docs: list[dict], tmp_path: Path, pki) -> None:
        sts = one(docs, "StatefulSet", "-etcd")
        self.name = sts["metadata"]["name"]
        self.headless = sts["spec"]["serviceName"]
        self.members = [Member(f"{self.name}-{i}") for i in range(sts["spec"]["replicas"])]
        self.tmp = tmp_path
        # The release's Secret, as the pods mount it: one pair for server and client
        tls_dir = tmp_path / "tls"
        tls_dir.mkdir(exist_ok=True)
        shutil.copy(pki.server.ca_file, tls_dir / "ca.crt")
        shutil.copy(pki.server.cert_file, tls_dir / "tls.crt")
        shutil.copy(pki.server.key_file, tls_dir / "tls.key")
        self.tls_dir = tls_dir
        self.client_tls = pki.client
        self.binary = shutil.which("etcd") or "/usr/bin/etcd"

    def argv(self, docs: list[dict], i: int) -> list[str]:
        """Member i's command line from the rendered StatefulSet (`docs`), its names and
        ports moved to 127.0.0.1 and its mounts to this test's files."""
        sts = one(docs, "StatefulSet", "-etcd")
        container = sts["spec"]["template"]["spec"]["containers"][0]
        mounts = container["volumeMounts"]
        mount = next((m["mountPath"] for m in mounts if m["name"] == "tls"), None)
        me = self.members[i]
        out = [self.binary]
        for a in container["args"]:
            a = a.replace("$(POD_NAME)", me.name)
            for m in self.members:
                host = f"{m.name}.{self.headless}.{NAMESPACE}.svc"
                a = a.replace(f"{host}:2380", f"127.0.0.1:{m.peer}")
                a = a.replace(f"{host}:2379", f"127.0.0.1:{m.client}")
            a = a.replace("0.0.0.0:2379", f"127.0.0.1:{me.client}")
            a = a.replace("0.0.0.0:2380", f"127.0.0.1:{me.peer}")
            a = a.replace("0.0.0.0:2381", f"127.0.0.1:{me.metrics}")
            if mount is not None:
                a = a.replace(mount + "/", str(self.tls_dir) + "/")
            if a.startswith("--data-dir="):
                a = f"--data-dir={self.tmp / me.name}"
            out.append(a)
        assert not [a for a in out if ".svc" in a or "0.0.0.0" in a], out
        return out

    def start(self, docs: list[dict], i: int) -> None:
        m = self.members[i]
        argv = self.argv(docs, i)
        m.serves_tls = f"--listen-client-urls=https://127.0.0.1:{m.client}" in argv
        with open(self.tmp / f"{m.name}.log", "ab") as log:
            m.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

    def stop(self, i: int) -> None:
        m = self.members[i]
        if m.proc is not None:
            _stop_proc(m.proc, timeout=20)
        m.proc = None

    def stop_all(self) -> None:
        for i in range(len(self.members)):
            self.stop(i)

    def logs(self) -> str:
        return "\n".join(
            f"--- {m.name}\n" + (self.tmp / f"{m.name}.log").read_text(errors="replace")[-1500:]
            for m in self.members
            if (self.tmp / f"{m.name}.log").exists()
        )

    def healthy(self, m: Member) -> bool:
        """m answers /health true (a leader, a quorum read) to a client of the CA."""
        return etcd_healthy(m.endpoint, 2.0, self.client_tls if m.serves_tls else None)

    def wait_healthy(self) -> None:
        """Every member healthy."""

        def healthy() -> bool:
            for m in self.members:
                if m.proc is not None and m.proc.poll() is not None:
                    raise AssertionError(f"{m.name} exited:\n{self.logs()}")
            return all(self.healthy(m) for m in self.members)

        try:
            wait_for(healthy, 60, what="every etcd member healthy")
        except Exception as exc:  # etcd's own words with the failure
            raise AssertionError(f"{exc}\n{self.logs()}") from exc

    def v3(self, i: int, path: str, body: dict) -> dict:
        """etcd's JSON gateway on member i's client port, as a client of the CA (over
        plain HTTP where that member serves no TLS)."""
        m = self.members[i]
        ctx = client_context(self.client_tls) if m.serves_tls else None
        scheme = "https" if ctx else "http"
        req = urllib.request.Request(
            f"{scheme}://{m.endpoint}/v3/{path}", data=json.dumps(body).encode()
        )
        with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
            return json.loads(r.read())

    def try_v3(self, i: int, path: str, body: dict) -> dict | None:
        """v3, or None where it failed (etcd's request timeout, a leader being chosen)."""
        try:
            return self.v3(i, path, body)
        except OSError:  # URLError, HTTPError and timeouts among them
            return None

    def peer_urls(self) -> dict[str, list[str]]:
        """Each member's peer URLs as the cluster records them."""
        listed = self.v3(0, "cluster/member/list", {})["members"]
        return {m["name"]: m["peerURLs"] for m in listed}

    def put(self, i: int, key: bytes, value: bytes) -> None:
        b64 = base64.b64encode
        self.v3(i, "kv/put", {"key": b64(key).decode(), "value": b64(value).decode()})

    def get(self, i: int, key: bytes) -> bytes | None:
        got = self.v3(i, "kv/range", {"key": base64.b64encode(key).decode()})
        kvs = got.get("kvs") or []
        return base64.b64decode(kvs[0]["value"]) if kvs else None


def _plaintext_answer(port: int) -> bytes:
    """What the peer port answers a plaintext request for its member list."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /members HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        s.settimeout(10)
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except OSError:
            pass
    return data


def _peer_members(port: int, ca_file: str, tls) -> str:
    """GET /members on a peer port over TLS presenting `tls`'s pair (None: none): the
    answer's body, or what went wrong."""
    ctx = ssl.create_default_context(cafile=ca_file)
    if tls is not None:
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
    try:
        with urllib.request.urlopen(
            f"https://127.0.0.1:{port}/members", timeout=10, context=ctx
        ) as r:
            return r.read().decode()
    except OSError as exc:  # ssl.SSLError and URLError among them
        return f"refused: {type(exc).__name__}: {exc}"


def _peer_tls_refusals(members: Members, pki) -> None:
    """The peer ports take no plaintext, no caller without a certificate or with one of
    another CA, and (etcd's own check on peer ports) none whose names do not cover the
    caller's address: kvctl's client pair of the same CA, which names no address, is
    refused too. The members' pair, naming 127.0.0.1 here (in the chart, the headless
    Service's name, which resolves to every member's pod IP), gets the member list."""
    ca = pki.server.ca_file
    for m in members.members:
        answer = _plaintext_answer(m.peer)
        assert b"200 OK" not in answer and b"peerURLs" not in answer, answer[:300]
        for who, pair in (("none", None), ("another CA", pki.stranger), ("kvctl", pki.client)):
            assert _peer_members(m.peer, ca, pair).startswith("refused"), who
        listed = json.loads(_peer_members(m.peer, ca, pki.server))
        assert sorted(x["name"] for x in listed) == [n.name for n in members.members]


def test_the_rendered_members_form_a_cluster_over_mutual_tls(helm, tmp_path, pki):  # noqa: F811
    docs = render(helm, VALUES, *TLS)
    members = Members(docs, tmp_path, pki)
    try:
        for i in range(len(members.members)):
            members.start(docs, i)
        members.wait_healthy()
        urls = members.peer_urls()
        assert len(urls) == 3 and all(u[0].startswith("https://") for u in urls.values()), urls
        members.put(0, b"/probe", b"replicated")
        for i in range(3):  # every member has it: replication ran over the TLS peer links
            assert wait_for(lambda i=i: members.get(i, b"/probe"), 30) == b"replicated"
        _peer_tls_refusals(members, pki)
    finally:
        members.stop_all()


def _move_peers(members: Members, after: list[dict], scheme: str) -> None:
    """The README's steps: each member restarted from the highest ordinal as the
    StatefulSet rolls (its args from `after`), then its new peer URL recorded from
    another member (a single member records its own), and the cluster healthy again
    with a write through the restarted member before the next."""
    n = len(members.members)
    member_ids = {m["name"]: m["ID"] for m in members.v3(0, "cluster/member/list", {})["members"]}
    for i in reversed(range(n)):  # the StatefulSet's rolling order
        members.stop(i)
        members.start(after, i)
        other = next((j for j in range(n) if j != i), i)
        new_url = f"{scheme}://127.0.0.1:{members.members[i].peer}"
        update = {"ID": member_ids[members.members[i].name], "peerURLs": [new_url]}
        # the member restarted may have been the leader: until another is elected the
        # update times out, and the operator runs it again (the README says so)
        wait_for(lambda o=other, u=update: members.try_v3(o, "cluster/member/update", u), 60)
        members.wait_healthy()
        members.put(i, f"/moved/{i}".encode(), b"yes")  # reaches the others (below)


def _every_key_kept(members: Members, scheme: str) -> None:
    n = len(members.members)
    urls = members.peer_urls()
    assert len(urls) == n and all(u[0].startswith(f"{scheme}://") for u in urls.values()), urls
    for i in range(n):
        for k in range(20):
            assert members.get(i, f"/keys/{k}".encode()) == f"value {k}".encode()
        for j in range(n):
            assert wait_for(lambda i=i, j=j: members.get(i, f"/moved/{j}".encode()), 30)


def _started_with_keys(members: Members, docs: list[dict], scheme: str) -> None:
    n = len(members.members)
    for i in range(n):
        members.start(docs, i)
    members.wait_healthy()
    assert all(u[0].startswith(f"{scheme}://") for u in members.peer_urls().values())
    for k in range(20):
        members.put(k % n, f"/keys/{k}".encode(), f"value {k}".encode())


@pytest.mark.parametrize("replicas", [3, 1])
def test_the_readmes_steps_move_plaintext_peers_to_tls_keeping_every_key(
    helm,  # noqa: F811
    tmp_path,
    pki,
    replicas,
):
    """Members made by a release with plaintext peers, upgraded with tls.etcdPeers=tls:
    the StatefulSet restarts them one at a time from the highest ordinal, and as each
    comes back on TLS, `etcdctl member update` (here etcd's JSON gateway, the same call)
    from another member records its https:// peer URL (a single member records its
    own). Quorum holds throughout; every key is kept."""
    sized = f"etcd.bundled.replicas={replicas}"
    before = render(helm, VALUES, *TLS, sized, "tls.etcdPeers=plaintext")
    after = render(helm, VALUES, *TLS, sized, "tls.etcdPeers=tls")
    members = Members(before, tmp_path, pki)
    assert len(members.members) == replicas
    try:
        _started_with_keys(members, before, "http")
        _move_peers(members, after, "https")
        _every_key_kept(members, "https")
        _peer_tls_refusals(members, pki)
    finally:
        members.stop_all()


def test_the_steps_in_reverse_move_tls_peers_back_to_plaintext(helm, tmp_path, pki):  # noqa: F811
    """Turning tls.etcd off over members that talk TLS (the chart asks for
    tls.etcdPeers=plaintext too): the same steps, each member's http:// URL recorded as
    it restarts without its certificates; every key is kept."""
    before = render(helm, VALUES, *TLS)
    after = render(helm, VALUES, *TLS, "tls.etcd=false", "tls.etcdPeers=plaintext")
    members = Members(before, tmp_path, pki)
    try:
        _started_with_keys(members, before, "https")
        _move_peers(members, after, "http")
        _every_key_kept(members, "http")
        assert all(not m.serves_tls for m in members.members)
    finally:
        members.stop_all()


def test_a_rollout_of_every_member_onto_tls_without_the_steps_loses_quorum(
    helm,  # noqa: F811
    tmp_path,
    pki,
):
    """Why the README moves one member at a time with the StatefulSet's partition: a
    member restarted with TLS-only peers still reaches the others (it dials their
    recorded http:// URLs itself), so it is healthy again and a free rollout goes on;
    once every member has restarted, no member takes the plaintext the records ask for
    and none is healthy. The partition holds the rollout back (rendered here)."""
    before = render(helm, VALUES, *TLS, "tls.etcdPeers=plaintext")
    after = render(helm, VALUES, *TLS, "tls.etcdPeers=tls")
    held = render(helm, VALUES, *TLS, "tls.etcdPeers=tls", "etcd.bundled.updatePartition=3")
    sts = one(held, "StatefulSet", "-etcd")["spec"]
    assert sts["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"partition": 3}}
    assert one(after, "StatefulSet", "-etcd")["spec"]["updateStrategy"]["rollingUpdate"] == {
        "partition": 0
    }
    members = Members(before, tmp_path, pki)
    try:
        _started_with_keys(members, before, "http")
        for i in (2, 1):  # each comes back healthy: nothing would stop the rollout
            members.stop(i)
            members.start(after, i)
            members.wait_healthy()
        members.stop(0)
        members.start(after, 0)
        first = members.members[0]

        def listening() -> bool:
            try:
                socket.create_connection(("127.0.0.1", first.client), timeout=1).close()
                return True
            except OSError:
                return False

        wait_for(listening, 30, what="the last member to listen")
        # the others came back healthy within seconds above; now none does, for 15 s
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            healthy = [m.name for m in members.members if members.healthy(m)]
            assert not healthy, f"{healthy} healthy:\n{members.logs()}"
            time.sleep(0.5)
    finally:
        members.stop_all()
