"""NVMe tier demote/promote rates with and without encryption at rest:
`python -m loadtest.bench_nvme` (also part of `python -m loadtest.bench_agent`).

Measures in one run, on this machine, the block store's own tier moves (kvstore/store*.py
over a real RocksDB tier, in process: no RPC in the way) for 2 MiB blocks (Llama-3-8B, 16
tokens, fp16), each round on a fresh RocksDB directory, plaintext and encrypted rounds
alternating, the median of `--rounds` (5):
- nvme_demote_gbps / nvme_demote_enc_gbps: pool -> RocksDB (BlockStore.persist_pool, the
  spill path `_write_nvme`, then a flush so the bytes are written out)
- nvme_promote_gbps / nvme_promote_enc_gbps: RocksDB -> pool after a restart (a Get of the
  whole chain: every block read, opened when sealed, verified and promoted)
- nvme_recover_gbps / nvme_recover_enc_gbps: the restart's recovery scan (every record read
  and verified; sealed ones opened too)
- aesgcm_seal_gbps / aesgcm_open_gbps: AES-256-GCM of one 2 MiB record alone (cryptography)
Reads after the restart mostly come from the page cache (just written): the figures are the
tier's CPU cost, which is what encryption adds; a cold NVMe read costs both modes alike.

Each encrypted figure is set against the plaintext one of the same run: `*_enc_ratio` must
be at least ENC_RATIO_LIMIT. Ends with one JSON line on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvstore.hashing import BlockId, hash_chain
from kvstore.namespace import Namespace
from kvstore.store import BlockStore, PutItem
from kvstore.tiers.pool import DevicePool
from kvstore.tiers.rocks import RocksTier
from kvstore.tiers.sealing import Keyring, Sealer, generate_key

MiB = 1 << 20
BLOCK = 2 * MiB
ENC_RATIO_LIMIT = 0.5  # encryption may cost at most half the tier's throughput


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def llama3_8b(name: str, **kw) -> Namespace:
    """Llama-3-8B's KV layout (2 MiB blocks of 16 tokens, fp16): the benchmarks' default."""
    base = dict(
        tenant="bench",
        name=name,
        model_name="llama-3-8b",
        model_revision="r1",
        adapter_id="none",
        adapter_revision="none",
        tokenizer_id="llama3",
        tokenizer_revision="r1",
        rope_type="llama3",
        rope_theta=500000.0,
        rope_scaling="none",
        attention_impl="sdpa",
        kv_dtype="float16",
        prompt_template_version="v1",
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        tp_rank=0,
        tp_size=1,
        block_size=16,
    )
    base.update(kw)
    return Namespace(**base)


def spec() -> Namespace:
    return llama3_8b("nvme", public=True)


def open_store(path: Path, n: int, sealer: Sealer | None) -> BlockStore:
    # Memtables larger than a round: the agent's default (32 MiB each) would stall the
    # demotion behind a flush (a stalled spill is dropped, see kvstore/tiers/rocks.py);
    # the flush that writes them out is timed as part of the demotion.
    rocks = RocksTier(str(path), 2 * n * BLOCK, flush_bytes=4 * n * BLOCK, sealer=sealer)
    return BlockStore(DevicePool(n, BLOCK, "cpu"), rocks)


def one_round(path: Path, n: int, sealer: Sealer | None) -> dict[str, float]:
    """Seconds to demote, recover and promote n blocks of one chain."""
    ns = spec()
    assert ns.block_bytes == BLOCK
    ids = hash_chain(BlockId(bytes(16)), np.arange(n * 16, dtype=np.int32), 16)
    parents = [bytes(16)] + ids[:-1]
    store = open_store(path, n, sealer)
    st = store.open_namespace(ns)
    store.put(st.ns_id, 0, [PutItem(b, p, os.urandom(BLOCK)) for b, p in zip(ids, parents)])
    t = time.perf_counter()
    assert store.persist_pool() == n
    assert store.rocks is not None and store.rocks.flush()
    demote = time.perf_counter() - t
    store.rocks.close()

    again = open_store(path, n, sealer)
    t = time.perf_counter()
    assert again.recover()["recovered"] == n
    recover = time.perf_counter() - t
    st = again.open_namespace(ns)
    bufs = [bytearray(BLOCK) for _ in range(n)]
    t = time.perf_counter()
    served = again.get(st.ns_id, 0, ids, bytes(16), lambda i, nbytes: bufs[i])
    promote = time.perf_counter() - t
    assert len(served) == n and again.counters["promotions"] == n
    assert again.rocks is not None
    again.rocks.close()
    return {"demote": demote, "recover": recover, "promote": promote}


def aesgcm_rates(reps: int = 20) -> dict[str, float]:
    sealer = Sealer({"bench": Keyring("bench", {1: generate_key()}, 1)})
    data, key = os.urandom(BLOCK), bytes(32)
    t = time.perf_counter()
    for _ in range(reps):
        record = sealer.seal(key, "bench", data)
    seal = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(reps):
        sealer.open(key, "bench", record)
    opened = time.perf_counter() - t
    gb = reps * BLOCK / 1e9
    return {"aesgcm_seal_gbps": gb / seal, "aesgcm_open_gbps": gb / opened}


def nvme_rates(n: int = 64, rounds: int = 5) -> dict[str, float]:
    """Every figure of this benchmark (bench_agent adds them to its own)."""
    sealer = Sealer({"bench": Keyring("bench", {1: generate_key()}, 1)})
    gb = n * BLOCK / 1e9
    modes = (("", None), ("_enc", sealer))
    times: dict[str, list[dict[str, float]]] = {suffix: [] for suffix, _ in modes}
    with tempfile.TemporaryDirectory(prefix="kvbench-nvme-") as tmp:
        # Plaintext and encrypted rounds alternate: a busy host slows both alike.
        for r in range(rounds):
            for suffix, seal in modes:
                log(f"NVMe tier{' encrypted' if seal else ''}: round {r + 1}/{rounds} ...")
                times[suffix].append(one_round(Path(tmp) / f"r{suffix}{r}", n, seal))
    out: dict[str, float] = {}
    for suffix, _ in modes:
        for what in ("demote", "recover", "promote"):
            median = statistics.median(t[what] for t in times[suffix])
            out[f"nvme_{what}{suffix}_gbps"] = gb / median
    out.update(aesgcm_rates())
    for what in ("demote", "promote", "recover"):
        out[f"nvme_{what}_enc_ratio"] = out[f"nvme_{what}_enc_gbps"] / out[f"nvme_{what}_gbps"]
    return out


def check(res: dict[str, float]) -> list[str]:
    """The figures that missed their limit."""
    return [
        f"nvme_{w}_enc_ratio {res[f'nvme_{w}_enc_ratio']:.2f} < {ENC_RATIO_LIMIT}"
        for w in ("demote", "promote")
        if res[f"nvme_{w}_enc_ratio"] < ENC_RATIO_LIMIT
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=64, help="2 MiB blocks per round")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    if args.blocks < 1 or args.rounds < 1:
        p.error("--blocks and --rounds must be >= 1")
    res: dict[str, object] = {"block_bytes": BLOCK, "blocks": args.blocks, "rounds": args.rounds}
    rates = nvme_rates(args.blocks, args.rounds)
    missed = check(rates)
    res.update({k: float(f"{v:.4g}") for k, v in rates.items()})  # 4 significant digits
    res["enc_ratio_limit"] = ENC_RATIO_LIMIT
    res["ok"] = not missed
    res["missed"] = missed
    print(json.dumps(res))
    return 0 if not missed else 1


if __name__ == "__main__":
    sys.exit(main())
