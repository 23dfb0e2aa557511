"""What the tests share that is not a fixture: process wrappers for etcd and agents on
127.0.0.1 with free ports, waiting, namespaces, prompts and chains, RocksDB damage, the
store factory behind the `make_store` fixture (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


from kvstore.devprocs import free_port
from kvstore.namespace import Namespace

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def ucx_dial(*args: str) -> dict:
    """Run tests/support/ucx_dial.py with `args` (a subprocess: ucxx stays out of pytest);
    its last JSON line."""
    r = subprocess.run(
        [PY, str(ROOT / "tests" / "support" / "ucx_dial.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    assert lines, (r.returncode, r.stdout, r.stderr[-3000:])
    return json.loads(lines[-1])


def python_json(*args: str, timeout: float = 120) -> dict:
    """Run `python *args` from the checkout in a fresh interpreter and return the JSON line
    its output ends with; a non-zero exit fails the test with the end of its stderr."""
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def wait_for(pred, timeout: float = 20.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


class Lines:
    """A process's output pipe read line by line by a daemon thread, so that a test
    waits for a line with a deadline: a bare readline() hangs when the process prints
    something else first, or nothing. Failures quote what it printed."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._ended = threading.Event()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        try:
            for line in iter(stream.readline, ""):
                self.lines.append(line)
        finally:
            stream.close()
            self._ended.set()

    def text(self) -> str:
        return "".join(self.lines)

    def wait_line(self, needle: str, timeout: float = 60.0) -> str:
        """The first line containing `needle`; AssertionError, with everything read so
        far, when the output ends without it or `timeout` passes."""

        def seen() -> str | bool:
            found = next((line for line in list(self.lines) if needle in line), None)
            return found or self._ended.is_set()

        try:
            found = wait_for(seen, timeout, what=f"a line with {needle!r}")
        except TimeoutError:
            found = None
        if not isinstance(found, str):
            raise AssertionError(f"no line with {needle!r} (output so far: {self.text()!r})")
        return found

    def rest(self, timeout: float = 60.0) -> str:
        """All of it, once the pipe closed (the process exited)."""
        if not self._ended.wait(timeout):
            raise AssertionError(f"output still open after {timeout}s: {self.text()!r}")
        return self.text()


def _stop_proc(proc: subprocess.Popen, sig=signal.SIGTERM, timeout: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


class EtcdProc:
    def __init__(self, data_dir: Path, tls=None) -> None:
        """`tls`: a kvstore.config.TLSConfig: etcd serves TLS with that pair and requires
        a client certificate of its CA (--client-cert-auth), as kvctl cluster up --tls."""
        self.tls = tls
        self.data_dir = data_dir
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log = data_dir.parent / "etcd.log"
        self.started = False  # healthy once: a restart keeps the ports

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self, attempts: int = 5) -> None:
        """Start etcd and wait until it is healthy. Its ports come from free_port(), and
        another process may take one before etcd binds it (seen in the suite: "bind:
        address already in use"); etcd then exits, and a first start is made again on
        fresh ports. A restart (after stop(), the same data and the endpoint the agents
        were given) keeps its ports. Any other exit is reported at once, with etcd's
        own words."""
        if self.started:
            attempts = 1
        for attempt in range(attempts):
            offset = self.log.stat().st_size if self.log.exists() else 0
            self.proc = subprocess.Popen(
                self._argv(), stdout=open(self.log, "ab"), stderr=subprocess.STDOUT
            )
            proc = self.proc
            wait_for(lambda p=proc: p.poll() is not None or self._healthy(), 30, what="etcd health")
            if proc.poll() is None:
                self.started = True
                return
            with open(self.log, "rb") as f:
                f.seek(offset)
                said = f.read().decode(errors="replace")
            if "address already in use" not in said or attempt == attempts - 1:
                raise RuntimeError(f"etcd exited with {proc.returncode}: {said[-2000:]}")
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.client_port, self.peer_port = free_port(), free_port()

    def _argv(self) -> list[str]:
        from kvstore.devcluster import etcd_command

        scheme = "https" if self.tls is not None else "http"
        cu = f"{scheme}://127.0.0.1:{self.client_port}"
        pu = f"{scheme}://127.0.0.1:{self.peer_port}"
        binary = shutil.which("etcd") or "/usr/bin/etcd"
        return etcd_command(binary, "test", self.data_dir, cu, pu, self.tls)

    def _healthy(self) -> bool:
        from kvstore.devprocs import etcd_healthy

        return etcd_healthy(self.endpoint, tls=self.tls)

    def stop(self) -> None:
        if self.proc is not None:
            _stop_proc(self.proc)
            self.proc = None


class AgentProc:
    def __init__(self, workdir: Path, config: dict) -> None:
        self.workdir = workdir
        self.config = config
        self.proc: subprocess.Popen | None = None
        self.address = ""

    def start(self, timeout: float = 60.0) -> "AgentProc":
        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg_path = self.workdir / "agent.json"
        cfg_path.write_text(json.dumps(self.config))
        ready = self.workdir / "ready"
        if ready.exists():
            ready.unlink()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [PY, "-m", "node_agent", "--config", str(cfg_path), "--ready-file", str(ready)],
            cwd=ROOT,
            env=env,
            stdout=open(self.workdir / "agent.log", "ab"),
            stderr=subprocess.STDOUT,
        )

        def is_ready():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"agent exited with {self.proc.returncode}: "
                    f"{(self.workdir / 'agent.log').read_text()[-2000:]}"
                )
            return ready.exists() and ready.read_text().strip()

        self.address = wait_for(is_ready, timeout, what="agent ready file")
        return self

    def stop(self) -> None:
        if self.proc is not None:
            _stop_proc(self.proc)
            self.proc = None

    def kill(self) -> None:
        if self.proc is not None:
            _stop_proc(self.proc, signal.SIGKILL)
            self.proc = None

    def restart(self) -> "AgentProc":
        self.stop()
        # Rebind the same port so clients keep their address.
        self.config["listen"] = self.address
        return self.start()

    @property
    def log(self) -> str:
        return (self.workdir / "agent.log").read_text()


NS_DEFAULTS = dict(
    tenant="acme",
    name="chat",
    model_name="tiny-llama",
    model_revision="r1",
    adapter_id="none",
    adapter_revision="none",
    tokenizer_id="tiny-tok",
    tokenizer_revision="r1",
    rope_type="default",
    rope_theta=10000.0,
    rope_scaling="none",
    attention_impl="sdpa",
    kv_dtype="float16",
    prompt_template_version="v1",
    num_layers=2,
    num_kv_heads=2,
    head_dim=16,
    tp_rank=0,
    tp_size=1,
    block_size=16,
)


def proc_status_bytes(pid: int, field: str) -> int:
    """A size line of /proc/PID/status (VmRSS, VmHWM, RssShmem, ...), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) << 10
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def make_namespace(**overrides) -> Namespace:
    return Namespace(**{**NS_DEFAULTS, **overrides})


# ---------------------------------------------------------------------------------------
# In-process BlockStore helpers (test_store, test_eviction, test_accounting, test_agent).
# Appended; the fixtures above are unchanged.


class ManualClock:
    """An injected clock: tests move time explicitly instead of sleeping."""

    def __init__(self, t: float = 1_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


TEST_SECRET = b"tenant-secret-for-tests"


def prompt_tokens(seed: int, n_tokens: int) -> list[int]:
    """Deterministic token ids; the same seed always gives the same prompt."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(0, 128_000) for _ in range(n_tokens)]


def block_payload(block_id: bytes, nbytes: int) -> bytes:
    """Deterministic payload for a block id: equal prefixes carry equal KV, as in a model."""
    import hashlib

    return hashlib.shake_128(block_id).digest(nbytes)


def chain_items(spec, tokens, secret=TEST_SECRET, generation: int = 0, start: int = 0):
    """(ids, items) for the full blocks of `tokens`, items from block `start` on."""
    from kvstore.hashing import hash_chain
    from kvstore.store import PutItem

    root = spec.root(generation, None if spec.public else secret)
    ids = hash_chain(root, tokens, spec.block_size)
    items = [
        PutItem(ids[i], ids[i - 1] if i else root, block_payload(ids[i], spec.block_bytes))
        for i in range(start, len(ids))
    ]
    return ids, items


def open_rocks_raw(path):
    """The agent's RocksDB opened with rocksdict directly, for fault injection."""
    from rocksdict import Options, Rdict

    opts = Options(raw_mode=True)
    return Rdict(
        str(path),
        opts,
        column_families={"blocks": Options(raw_mode=True), "meta": Options(raw_mode=True)},
    )


def flip_rocks_byte(path, key: bytes | None = None, offset: int = -1) -> bytes:
    """Flip one byte of one stored block record (the first one when key is None), with the
    owning process stopped. Returns the key that was damaged."""
    db = open_rocks_raw(path)
    try:
        blocks = db.get_column_family("blocks")
        if key is None:
            it = blocks.iter()
            it.seek_to_first()
            assert it.valid(), "no block records on disk"
            key = it.key()
            del it
        raw = bytearray(blocks[key])
        raw[offset] ^= 0x5A
        blocks[key] = bytes(raw)
        db.flush()
        del blocks
    finally:
        db.close()
    return key


def store_maker(tmp_path, device: str):
    """make_store's factory with the DevicePool on `device` (a generator: yields `make`,
    then closes the RocksDB tiers it opened); tests/gpu/test_cuda.py uses it with a GPU."""
    from kvstore.store import BlockStore
    from kvstore.tiers.pool import DevicePool
    from kvstore.tiers.rocks import RocksTier

    made = []

    def make(
        n_slots: int = 8,
        nvme_bytes: int = 1 << 20,
        path=None,
        slot_bytes: int = 0,
        sealer=None,
        **kwargs,
    ) -> BlockStore:
        pool = DevicePool(n_slots, slot_bytes or make_namespace().block_bytes, device)
        where = str(path or tmp_path / "rocks")
        rocks = RocksTier(where, nvme_bytes, sealer=sealer) if nvme_bytes else None
        store = BlockStore(pool, rocks, **kwargs)
        made.append(store)
        return store

    yield make
    for store in made:
        if store.rocks is not None:
            store.rocks.close()
