"""The UCX build that matches the CUDA this environment's torch was built for.

Run by the Dockerfile after torch is installed (`python ucx_requirement.py` prints the
requirement lines of the matching extra from pyproject.toml, for `pip install -r`) and by
check_install.py (which asserts that build is the one installed). UCX wheels are built per
CUDA major version: a CUDA 13 torch with `ucxx-cu12` cannot register device memory, so the
extra follows torch rather than being fixed. A CPU torch gets the cu12 build, which runs
without a GPU (shared memory and TCP), as `make install` uses it.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

# CUDA major version of torch (None: a CPU build) -> the pyproject extra holding its UCX.
EXTRAS: dict[str | None, str] = {None: "ucx", "12": "ucx", "13": "ucx-cu13"}


def torch_cuda_major() -> str | None:
    import torch

    version = torch.version.cuda
    return version.split(".")[0] if version else None


def extra_for(major: str | None) -> str:
    if major not in EXTRAS:
        raise SystemExit(
            f"no UCX build is known for CUDA {major}: add a ucx-cu{major} extra to "
            "pyproject.toml and to EXTRAS in deploy/docker/ucx_requirement.py"
        )
    return EXTRAS[major]


def requirements(pyproject: Path, extra: str) -> list[str]:
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    return list(extras[extra])


def main() -> None:
    pyproject = Path(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml")
    print("\n".join(requirements(pyproject, extra_for(torch_cuda_major()))))


if __name__ == "__main__":
    main()
