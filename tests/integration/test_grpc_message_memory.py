"""An agent serving Gets over gRPC reuses its message memory (kvstore.process.
keep_message_buffers, set at the agent's start): without it glibc mapped every multi-MiB
message and its copies afresh and faulted them in page by page, about 760 page faults per
MiB served here, which halved gRPC Get throughput (bench_agent's grpc_get_gbps)."""

from __future__ import annotations

import torch
from support.common import make_namespace, prompt_tokens

from kvstore.client import KVClient
from kvstore.client.convert import block_shape, torch_dtype
from kvstore.config import MiB

NS = make_namespace(num_layers=32, num_kv_heads=8, head_dim=128)  # 2 MiB blocks
BLOCKS, ROUNDS = 16, 10


def minor_faults(pid: int) -> int:
    """The process's minor page faults so far (/proc/PID/stat, field 10)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def test_grpc_gets_reuse_message_memory_instead_of_faulting_it_in_again(spawn_agent):
    assert NS.block_bytes == 2 * MiB
    agent = spawn_agent(slot_bytes="2MiB", pool_bytes="64MiB")
    g = torch.Generator().manual_seed(5)
    blocks = [
        torch.randn(block_shape(NS), generator=g).to(torch_dtype(NS.kv_dtype))
        for _ in range(BLOCKS)
    ]
    with KVClient(agent.address, use_shm=False, tenant_secret=b"s") as c:
        ns = c.open_namespace(NS)
        ids = c.block_ids(ns, prompt_tokens(1, BLOCKS * NS.block_size))
        assert c.put(ns, ids, blocks).stored == BLOCKS
        assert all(torch.equal(a, b) for a, b in zip(c.get(ns, ids), blocks))  # warms up
        before = minor_faults(agent.proc.pid)
        for _ in range(ROUNDS):
            got = c.get(ns, ids)
            assert len(got) == BLOCKS
        faults = minor_faults(agent.proc.pid) - before
    served_mib = ROUNDS * BLOCKS * NS.block_bytes // MiB
    # Faulting each message in afresh costs 256 faults per MiB per copy (4 KiB pages);
    # reused memory faults only where the first rounds had not reached yet.
    assert faults / served_mib < 64, f"{faults} page faults for {served_mib} MiB served"
