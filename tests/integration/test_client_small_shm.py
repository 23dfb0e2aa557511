"""A client whose /dev/shm is small (a container's default 64 MiB) must not die of SIGBUS
filling a staging area the filesystem cannot back: it takes a smaller area, or none and
payloads over gRPC, says so once, and serves correctly either way.

The client runs in a mount namespace of its own with a small tmpfs on /dev/shm (root: the
test suite runs as root in CI; elsewhere it skips saying why), so the agent cannot map its
region either, as between two containers."""

from __future__ import annotations

import os
import subprocess

import pytest
from support.common import PY, ROOT, make_namespace

CLIENT = r"""
import logging, sys, torch
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
from kvstore.client import KVClient
from kvstore.namespace import Namespace
spec = Namespace.from_dict(eval(sys.argv[2]))
c = KVClient(sys.argv[1], tenant_secret=b"small-shm-secret")  # asks for 256 MiB
print("staging_mib", (c._staging.size >> 20) if c._staging is not None else 0)
ns = c.open_namespace(spec)
tokens = list(range(5000, 5000 + 4 * spec.block_size))
kv = torch.randn((spec.num_layers, 2, len(tokens), spec.num_kv_heads, spec.head_dim),
                 generator=torch.Generator().manual_seed(3)).to(torch.float16)
c.store(ns, tokens, kv)
hit = c.fetch(ns, tokens)
same = hit.cached_blocks == 4 and torch.equal(torch.cat(hit.blocks, dim=2), kv)
print("round_trip", "identical" if same else "DIFFERENT")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for a private mount of /dev/shm")
@pytest.mark.parametrize("shm_mib, says", [(48, "using 32 MiB"), (8, "payloads go over gRPC")])
def test_small_dev_shm_gives_a_smaller_staging_area_or_grpc(spawn_agent, shm_mib, says):
    agent = spawn_agent()
    spec = make_namespace(name=f"small-shm-{shm_mib}")
    script = (
        f"mount -t tmpfs -o size={shm_mib}m tmpfs /dev/shm && exec {PY} -c "
        f"'{CLIENT}' {agent.address} \"{spec.to_dict()!r}\""
    )
    r = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-2000:]  # SIGBUS was exit 135
    assert r.stderr.count(says) == 1, r.stderr
    # The agent cannot map a region in another /dev/shm either: payloads over gRPC.
    assert "staging_mib 0" in r.stdout and "round_trip identical" in r.stdout
