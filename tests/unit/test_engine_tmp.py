"""kvstore/integrations/engine_tmp.py: the private temporary directory a vLLM engine gets
(its IPC sockets and file store), removed with what it holds, and never one whose path is
too long for the engine's sockets."""

from __future__ import annotations

import os
import socket
import stat
import tempfile

import pytest

from kvstore.integrations import engine_tmp
from kvstore.integrations.engine_tmp import engine_env, engine_tmpdir, fits_sockets


@pytest.fixture
def tmp_root(tmp_path, monkeypatch):
    """tempfile's directory for the test: a short one (tmp_path's own is too long for a
    socket path), under the host's temporary directory."""
    root = tempfile.mkdtemp(prefix="kvs-")
    monkeypatch.setattr(tempfile, "tempdir", root)
    yield root
    os.rmdir(root)  # empty: engine_tmpdir removed what it made


def test_the_directory_is_private_and_goes_with_a_bound_socket_in_it(tmp_root):
    with engine_tmpdir() as d:
        assert d is not None and os.path.dirname(d) == tmp_root
        assert os.path.basename(d).startswith(engine_tmp.PREFIX)
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
        # what vLLM leaves there: a socket named <dir>/<uuid4> (still bound) and a file
        path = os.path.join(d, "01234567-89ab-cdef-0123-456789abcdef")
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(path)
            open(os.path.join(d, "vllm_dist_0123"), "wb").close()
            with pytest.raises(RuntimeError):  # removed on the way out of an error too
                with engine_tmpdir() as inner:
                    assert inner is not None and os.path.isdir(inner)
                    raise RuntimeError("the engine failed")
            assert not os.path.exists(inner)
    assert not os.path.exists(d)
    assert os.listdir(tmp_root) == []


def test_env_points_the_engine_there_and_keeps_a_chosen_socket_directory():
    env = engine_env("/tmp/kvstore-vllm-x", {"PATH": "/bin", "TMPDIR": "/var/tmp"})
    assert env == {"PATH": "/bin", "TMPDIR": "/tmp/kvstore-vllm-x",
                   "VLLM_RPC_BASE_PATH": "/tmp/kvstore-vllm-x"}  # fmt: skip
    chosen = engine_env("/tmp/kvstore-vllm-x", {"VLLM_RPC_BASE_PATH": "/run/vllm"})
    assert chosen == {"TMPDIR": "/tmp/kvstore-vllm-x", "VLLM_RPC_BASE_PATH": "/run/vllm"}
    assert engine_env(None, {"TMPDIR": "/var/tmp"}) == {"TMPDIR": "/var/tmp"}


def test_a_temporary_directory_too_long_for_sockets_is_left_as_it_is(tmp_path, monkeypatch):
    # 107 bytes hold a socket path: <dir>/<36-character uuid> needs dir <= 70 bytes
    assert fits_sockets("/" + "d" * 69) and not fits_sockets("/" + "d" * 70)
    long_root = tmp_path / ("x" * 60)
    long_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_root))
    with engine_tmpdir() as d:
        assert d is None
    assert list(long_root.iterdir()) == []  # nothing made, nothing left
