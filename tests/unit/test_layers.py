"""The layering written down in pyproject.toml ([tool.importlinter]) holds, and every module
of the installed packages sits in a layer (a new module cannot slip past the contracts)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
CONTRACTS = {c["id"]: c for c in CONFIG["contracts"]}
LINT = Path(sys.executable).with_name("lint-imports")


@pytest.mark.parametrize("contract", ["layers", "core", "acyclic"])
def test_import_contract_is_kept(contract):
    r = subprocess.run(
        [str(LINT), "--no-cache", "--no-logo", "--contract", contract],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_module_is_in_a_layer_or_the_core():
    placed = set(CONTRACTS["core"]["source_modules"])
    for layer in CONTRACTS["layers"]["layers"]:
        placed.update(m.strip() for m in layer.replace(":", "|").split("|"))
    graph = grimp.build_graph(*CONFIG["root_packages"])
    unplaced = []
    for module in graph.modules:
        parts = module.split(".")
        prefixes = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        if module not in CONFIG["root_packages"] and not prefixes & placed:
            unplaced.append(module)
    assert not unplaced, f"modules in no layer (add them to pyproject.toml): {unplaced}"


CLIENT_ONLY = """
import importlib.abc, sys
SERVER_ONLY = {"rocksdict", "etcd3aio", "grpc_health", "prometheus_client", "matplotlib"}
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in SERVER_ONLY or name.startswith("opentelemetry.sdk"):
            raise ImportError(f"{name} is not installed with the client alone")
sys.meta_path.insert(0, Refuse())
import kvstore.client, kvstore.client.cluster, kvstore.client.convert
from kvstore.hashing import hash_chain
print(len(hash_chain(bytes(16), list(range(64)), 16)))
"""


def test_the_client_needs_none_of_the_server_dependencies():
    """A worker that installs kvstore (without the [server] extra) can import and use the
    client: RocksDB, etcd, the OpenTelemetry SDK, Prometheus and matplotlib stay out."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = " ".join(project["dependencies"])
    assert not any(
        dep in names
        for dep in ("rocksdict", "etcd3aio", "opentelemetry-sdk", "prometheus", "matplotlib")
    )
    r = subprocess.run(
        [sys.executable, "-c", CLIENT_ONLY], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and r.stdout.strip() == "4", r.stderr
