"""The native extension is never missing silently: where it must build (Linux
x86_64/aarch64) a source that does not compile fails the build with a message saying what
to do; elsewhere, or with KVSTORE_NATIVE_OPTIONAL=1, the build goes on and the pure-Python
fallback logs itself once and is named (the agent's Stats: tests/integration/
test_native_accel.py)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from support.common import PY, ROOT

from kvstore import checksum, hashing, native
from kvstore.native import OFF_ENV, OPTIONAL_ENV, must_build

FALLBACK_LOG = "use the pure-Python fallback"


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (OFF_ENV, OPTIONAL_ENV)}
    env["PYTHONPATH"] = str(ROOT)
    return {**env, **extra}


def test_where_the_extension_must_build():
    linux = {"sys_platform": "linux", "env": {}}
    assert must_build(machine="x86_64", **linux) and must_build(machine="aarch64", **linux)
    assert must_build(machine="AMD64", **linux)
    assert not must_build(machine="riscv64", **linux)
    assert not must_build(env={}, sys_platform="darwin", machine="arm64")
    assert not must_build(env={}, sys_platform="win32", machine="AMD64")
    assert not must_build(env={OPTIONAL_ENV: "1"}, sys_platform="linux", machine="x86_64")
    assert must_build(env={OPTIONAL_ENV: "0"}, sys_platform="linux", machine="x86_64")


@pytest.mark.skipif(not must_build(env={}), reason="the extension is optional on this platform")
def test_this_process_hashes_natively_where_it_must_build(monkeypatch):
    if os.environ.get(OFF_ENV) or os.environ.get(OPTIONAL_ENV):
        pytest.skip(f"{OFF_ENV} or {OPTIONAL_ENV} is set")
    assert hashing.NATIVE and checksum.NATIVE, native.active()
    assert native.active().startswith("native "), native.active()


def _project(tmp_path, broken: bool):
    """What setup.py needs to build the extension, in a directory of its own."""
    src = tmp_path / "src"
    for name in ("setup.py", "pyproject.toml"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "kvstore" / "native",
        src / "kvstore" / "native",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    if broken:
        glue = src / "kvstore" / "native" / "module.c"
        glue.write_text("#error deliberately broken by the test\n" + glue.read_text())
    return src


def _build(src, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "setup.py", "build_ext", "--inplace"],
        cwd=src,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.skipif(not must_build(env={}), reason="the extension is optional on this platform")
def test_broken_source_fails_the_build_with_a_message(tmp_path):
    src = _project(tmp_path, broken=True)
    r = _build(src)
    assert r.returncode != 0, r.stdout + r.stderr
    assert "deliberately broken by the test" in r.stderr  # the compiler's own words
    assert "error: building kvstore._native from kvstore/native/ failed" in r.stderr
    assert "must build on Linux x86_64/aarch64" in r.stderr
    assert f"{OPTIONAL_ENV}=1" in r.stderr and "build-essential python3-dev" in r.stderr
    assert not list(src.glob("kvstore/_native*.so"))

    r = _build(src, **{OPTIONAL_ENV: "1"})  # asked for: the install goes on, and says so
    assert r.returncode == 0, r.stderr
    assert "WARNING: building kvstore._native from kvstore/native/ failed" in r.stderr
    assert "pure-Python fallback" in r.stderr
    assert not list(src.glob("kvstore/_native*.so"))


def test_fallback_is_logged_once_and_named():
    code = (
        "from kvstore import checksum, hashing, native; "
        "print(hashing.NATIVE, checksum.NATIVE, native.active())"
    )
    r = subprocess.run(
        [PY, "-c", code],
        env=_env(**{OFF_ENV: "1"}),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"False False python (disabled by {OFF_ENV})"
    assert r.stderr.count(FALLBACK_LOG) == 1, r.stderr  # one line for both modules
    assert f"disabled by {OFF_ENV}" in r.stderr

    r = subprocess.run(
        [PY, "-m", "kvstore.native"],
        env=_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and FALLBACK_LOG not in r.stderr, r.stderr
    assert r.stdout.strip() == f"kvstore native acceleration: {native.active()}"
