"""A process that cannot start says why in one line and exits non-zero: no traceback for
the operator to decode (docs/runbook.md, 'A node agent that will not start')."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess

import pytest

from support.common import PY, ROOT, wait_for


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_agent_on_a_taken_port_exits_1_with_one_clear_line(spawn_agent, tmp_path):
    first = spawn_agent()
    r = _run(
        "-m",
        "node_agent",
        "--listen",
        first.address,
        "--device",
        "cpu",
        "--pool-bytes",
        "4MiB",
        "--slot-bytes",
        "64KiB",
        "--nvme-bytes",
        "0",
        "--data-dir",
        str(tmp_path / "second"),
        "--allow-unauthenticated",
    )
    assert r.returncode == 1
    assert f"kvstore-agent: cannot start: cannot listen on {first.address}" in r.stderr
    assert "Traceback" not in r.stderr


def test_router_on_a_taken_port_exits_1_with_one_clear_line(etcd, spawn_agent):
    taken = spawn_agent().address
    r = _run("-m", "router", "--listen", taken, "--etcd-endpoints", etcd.endpoint)
    assert r.returncode == 1
    assert f"kvstore-router: cannot start: cannot listen on {taken}" in r.stderr
    assert "Traceback" not in r.stderr


def test_agent_with_a_bad_size_exits_2_naming_the_field():
    r = _run("-m", "node_agent", "--pool-bytes", "12XB")
    assert r.returncode == 2
    assert "pool_bytes: invalid size unit 'XB'" in r.stderr and "Traceback" not in r.stderr


AGENT = ("-m", "node_agent", "--pool-bytes", "4MiB", "--slot-bytes", "64KiB",
         "--nvme-bytes", "0", "--allow-unauthenticated")  # fmt: skip


@pytest.mark.parametrize(
    "args, said",
    [  # each was a traceback (rc 1), or a port gRPC wrapped round (99999 bound 34463)
        (("--device", "gpu"), "device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
        (("--device", "cuda:abc"), "device must be auto, cpu, cuda or cuda:N, got 'cuda:abc'"),
        (("--etcd-endpoints", "garbage"), "etcd endpoint 'garbage' is not host:port"),
        (("--etcd-endpoints", "127.0.0.1:99999"), "the port must be in 1..65535"),
        (("--listen", "127.0.0.1:99999"), "listen must be host:port with a port in 0..65535"),
        (("--listen", "notaport"), "listen must be host:port"),
        (("--pool-bytes", "100TiB"), "pool_bytes (100.0 TiB) is more than this host's memory"),
    ],
)
def test_agent_refuses_what_it_cannot_run_with_before_starting(tmp_path, args, said):
    r = _run(*AGENT, "--data-dir", str(tmp_path / "d"), *args)
    assert r.returncode == 2, r.stderr[-2000:]
    assert said in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "d").exists()  # refused before anything was made


@pytest.mark.parametrize(
    "env, said",
    [
        ({"KVSTORE_AGENT_METRICS_PORT": "70000"}, "metrics_port must be in 0..65535"),
        ({"KVSTORE_AGENT_PEER_PORT": "-1"}, "peer_port must be in 0..65535"),
    ],
)
def test_agent_refuses_ports_out_of_range(tmp_path, env, said):
    r = subprocess.run(
        [PY, *AGENT, "--data-dir", str(tmp_path / "d")], cwd=ROOT, capture_output=True,
        text=True, timeout=120, env=dict(os.environ, **env),
    )  # fmt: skip
    assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_router_refuses_bad_settings_before_starting(tmp_path):
    cfg = tmp_path / "router.yaml"
    for argv, config, said in (
        (("--etcd-prefix", "nokv"), "", "--etcd-prefix must end with '/', got 'nokv'"),
        ((), "weight_recompute: .nan\n", "weight_recompute must be a finite number >= 0"),
        ((), "metrics_port: 70000\n", "metrics_port must be in 0..65535"),
        (("--listen", "127.0.0.1:99999"), "", "listen must be host:port"),
    ):
        cfg.write_text(config or "{}\n")
        r = _run("-m", "router", "--config", str(cfg), "--etcd-endpoints", "127.0.0.1:1", *argv)
        assert r.returncode == 2, (argv, r.stderr[-2000:])
        assert said in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for a private read-only mount")
def test_agent_on_a_read_only_filesystem_names_its_data_dir(tmp_path):
    """What a container with a read-only root and no volume on /var/lib/kvstore sees."""
    ro = tmp_path / "ro"
    ro.mkdir()
    agent = (
        f"{PY} -m node_agent --listen 127.0.0.1:0 --device cpu --pool-bytes 4MiB "
        f"--slot-bytes 64KiB --data-dir {ro}/agent-0 --allow-unauthenticated"
    )
    script = f"mount -t tmpfs -o ro tmpfs {ro} && exec {agent}"
    r = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1
    assert (
        f"kvstore-agent: cannot start: data_dir {ro}/agent-0 cannot be created "
        "(Read-only file system): mount a writable volume there" in r.stderr
    )
    assert "Traceback" not in r.stderr


def test_a_second_agent_on_a_data_dir_in_use_refuses_to_start_and_moves_nothing(spawn_agent):
    """The second agent took RocksDB's held LOCK for damage: it moved the running agent's
    files to a quarantine directory (two are kept, older ones deleted) and served with
    an empty tier."""
    first = spawn_agent()
    data_dir = first.config["data_dir"]
    before = sorted(os.listdir(data_dir))
    r = _run(
        "-m", "node_agent", "--listen", "127.0.0.1:0", "--device", "cpu", "--pool-bytes",
        "4MiB", "--slot-bytes", "64KiB", "--data-dir", data_dir, "--allow-unauthenticated",
    )  # fmt: skip
    assert r.returncode == 1, r.stderr[-2000:]
    assert f"data_dir {data_dir} is in use by another process" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert sorted(os.listdir(data_dir)) == before
    parent = os.path.dirname(data_dir.rstrip("/"))
    assert not [d for d in os.listdir(parent) if ".quarantine" in d]


def test_a_ready_file_in_a_missing_directory_stops_the_start(tmp_path):
    """It was found out after the listeners were up: a FileNotFoundError traceback, and
    the process kept its ports with no working event loop until killed."""
    ready = tmp_path / "nonexist" / "ready"
    r = _run(
        "-m", "node_agent", "--listen", "127.0.0.1:0", "--device", "cpu", "--pool-bytes",
        "4MiB", "--slot-bytes", "64KiB", "--data-dir", str(tmp_path / "data"),
        "--allow-unauthenticated", "--ready-file", str(ready),
    )  # fmt: skip
    assert r.returncode == 1, r.stderr[-2000:]
    assert f"--ready-file {ready}: directory {ready.parent} does not exist" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_missing_local_lane_group_is_named_before_recovery(tmp_path):
    """It was found after recovering the NVMe tier (up to minutes), followed by an
    'Exception ignored in Server.__del__' traceback."""
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("local_lane_group: no-such-group-here\n")
    r = _run(
        "-m", "node_agent", "--config", str(cfg), "--listen", "127.0.0.1:0", "--device",
        "cpu", "--pool-bytes", "4MiB", "--slot-bytes", "64KiB", "--data-dir",
        str(tmp_path / "data"), "--allow-unauthenticated",
    )  # fmt: skip
    assert r.returncode == 1, r.stderr[-2000:]
    assert "local_lane_group 'no-such-group-here': no such group on this host" in r.stderr
    assert "recovered" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "Exception ignored" not in r.stderr, r.stderr[-2000:]


def test_an_agent_whose_data_dir_is_a_file_says_so(tmp_path):
    """It said "cannot be created (File exists)", which sends an operator looking for a
    directory that is not there."""
    (tmp_path / "data").write_text("not a directory")
    r = _run(
        "-m", "node_agent", "--listen", "127.0.0.1:0", "--device", "cpu", "--pool-bytes",
        "4MiB", "--slot-bytes", "64KiB", "--data-dir", str(tmp_path / "data"),
        "--allow-unauthenticated",
    )  # fmt: skip
    assert r.returncode == 1, r.stderr[-2000:]
    assert f"data_dir {tmp_path}/data is a file, not a directory" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_router_whose_gateway_files_are_bad_says_so_before_waiting_for_etcd(tmp_path):
    """A missing tokenizer directory (or key file) stops the router at once, naming it,
    even with no etcd to reach: the files are read before anything waits for etcd."""
    from support.common import free_port

    keys = tmp_path / "keys.json"
    keys.write_text('{"key-acme": "acme"}')
    (tmp_path / "salt").write_text("s" * 32)
    cfg = tmp_path / "gateway.json"
    cfg.write_text(
        '{"tokenizers": {"tiny": "%s"}, "api_keys_file": "%s", "salt_key_file": "%s"}'
        % (tmp_path / "no-such-tokenizer", keys, tmp_path / "salt")
    )
    nobody = f"127.0.0.1:{free_port()}"  # no etcd there
    r = _run("-m", "router", "--listen", "127.0.0.1:0", "--etcd-endpoints", nobody,
             "--gateway-listen", "127.0.0.1:0", "--gateway-config", str(cfg))  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert "kvstore-router: cannot start: gateway:" in r.stderr
    assert "no-such-tokenizer" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("listen", ["127.0.0.1:99999", "nohost"])
def test_a_bad_gateway_listen_exits_2_with_one_line_before_anything_starts(etcd, tmp_path, listen):
    """Before the fix 127.0.0.1:99999 was an OverflowError traceback once the router had
    joined etcd, and nohost "cannot start: ... invalid literal for int()" (exit 1)."""
    from loadtest.vllm_model import write_word_tokenizer

    (tmp_path / "keys.json").write_text('{"key-acme": "acme"}')
    (tmp_path / "salt").write_text("s" * 32)
    cfg = tmp_path / "gateway.json"
    cfg.write_text(
        '{"tokenizers": {"tiny": "%s"}, "api_keys_file": "%s", "salt_key_file": "%s"}'
        % (write_word_tokenizer(tmp_path / "tok"), tmp_path / "keys.json", tmp_path / "salt")
    )
    r = _run("-m", "router", "--listen", "127.0.0.1:0", "--etcd-endpoints", etcd.endpoint,
             "--gateway-listen", listen, "--gateway-config", str(cfg))  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip() == (
        "kvstore-router: bad configuration: gateway listen must be host:port with a port in "
        f"0..65535, got {listen!r}"
    )


@pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="needs ucxx")
def test_an_agent_whose_ucx_listener_cannot_bind_serves_and_still_stops_on_sigterm(tmp_path):
    """A taken peer_port: UCX is down, peers use gRPC, and SIGTERM ends the process (ucxx's
    notifier thread, started before the listener failed, kept it alive after 'stopped')."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ready = tmp_path / "ready"
        proc = subprocess.Popen(
            [PY, *AGENT, "--data-dir", str(tmp_path / "d"), "--listen", "127.0.0.1:0",
             "--ready-file", str(ready)],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env=dict(os.environ, KVSTORE_AGENT_PEER_PORT=str(taken.getsockname()[1])),
        )  # fmt: skip
        try:
            wait_for(ready.exists, 60, 0.1, what="the agent serving")
            proc.send_signal(signal.SIGTERM)
            try:
                _, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                pytest.fail("the agent did not exit after SIGTERM")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, err[-2000:]
    assert "UCX unavailable" in err and "peers use the gRPC fallback" in err, err[-2000:]


@pytest.mark.parametrize("content", [None, "", "  \n"])
def test_a_router_cluster_token_file_that_is_missing_or_empty_exits_2(tmp_path, content):
    """An empty --cluster-token-file was taken as no token at all, without a word."""
    from support.common import free_port

    path = tmp_path / "cluster-token"
    if content is not None:
        path.write_text(content)
    nobody = f"127.0.0.1:{free_port()}"  # refused before anything waits for etcd
    r = _run("-m", "router", "--listen", "127.0.0.1:0", "--etcd-endpoints", nobody,
             "--cluster-token-file", str(path))  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    why = "No such file or directory" if content is None else "is empty"
    assert r.stderr.strip() == (
        f"kvstore-router: bad configuration: --cluster-token-file {path}"
        + (f": {why}" if content is None else f" {why}")
    )
