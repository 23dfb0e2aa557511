"""Run by the Dockerfile after `pip install .`, from /: the installed package (not the
source tree) has the C extension, and every console script and the servers they import
lazily resolve (catches a package that [tool.setuptools.packages.find] left out)."""

import importlib
import importlib.metadata as md

import kvstore._native  # noqa: F401  the fast path must be built in the image

for ep in md.distribution("kvstore").entry_points:
    if ep.group == "console_scripts":
        ep.load()
for name in ("node_agent.server", "router.server", "kvstore.cli.control_cmd"):
    importlib.import_module(name)
print("kvstore installed:", md.version("kvstore"))
