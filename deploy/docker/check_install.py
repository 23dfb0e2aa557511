"""Run by the Dockerfile after `pip install .`, from /: the installed package (not the
source tree) has the C extension, and every console script and the servers they import
lazily resolve (catches a package that [tool.setuptools.packages.find] left out), and the
UCX build matching torch's CUDA is installed and loads."""

import importlib
import importlib.metadata as md
from pathlib import Path

import kvstore._native  # noqa: F401  the fast path must be built in the image

for ep in md.distribution("kvstore").entry_points:
    if ep.group == "console_scripts":
        ep.load()
for name in ("node_agent.server", "router.server", "kvstore.cli.control_cmd"):
    importlib.import_module(name)
print("kvstore installed:", md.version("kvstore"))

# The UCX build must be the one for this torch's CUDA, and it must load: an agent without
# it silently falls back to gRPC for every peer transfer.
from ucx_requirement import extra_for, requirements, torch_cuda_major  # noqa: E402

extra = extra_for(torch_cuda_major())
for req in requirements(Path(__file__).resolve().parents[2] / "pyproject.toml", extra):
    name, _, version = req.partition("==")
    assert md.version(name) == version, f"{name}: {md.version(name)} installed, {version} wanted"
import ucxx  # noqa: E402

print("UCX:", extra, "ucx", ucxx.get_ucx_version())
