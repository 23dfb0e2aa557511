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


@pytest.mark.parametrize("contract", ["layers", "core"])
def test_import_contract_is_kept(contract):
    r = subprocess.run([str(LINT), "--no-cache", "--no-logo", "--contract", contract],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
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
