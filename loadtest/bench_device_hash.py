"""Device checksum benchmark: `python -m loadtest.bench_device_hash`.

How fast a GPU pool verifies payloads that landed in it (kvstore/device_hash.py: XXH64 by a
Triton kernel, one program per block), against limits measured in the same run on the same
bytes: a device-to-device copy (`limit_gbps`, what the GPU's memory moves) and the
host-to-device copy a pool without the kernel pays to stage payloads (`h2d_gbps`). The
kernel must outrun the network that fills the slots (25-50 GB/s for a 200-400 Gb/s NIC).

Without CUDA it measures the host side only (XXH64 of a pool slot and memcpy, the figures a
host pool's verification runs at) and says so: the interpreter the CPU tests use to check
the kernel is far too slow to time.

One JSON line on stdout: device, blocks, block_bytes, device_hash_gbps (all blocks in one
launch), device_hash_message_gbps (one 16 MiB message's blocks per launch),
device_hash_threads_gbps (the messages hashed from as many threads at once, as a receiver
does), limit_gbps, hash_ratio (device_hash / limit), h2d_gbps, host_xxh64_gbps,
host_memcpy_gbps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvstore import checksum as cks
from kvstore import device_hash
from node_agent.peer.ucx.wire import MESSAGE_BYTES

MiB = 1 << 20


def best_gbps(fn, nbytes: int, reps: int, sync=lambda: None) -> float:
    """Median GB/s of `reps` timed calls after one warm-up (compiles, faults pages in)."""
    fn()
    sync()
    rates = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=64, help="blocks hashed per call")
    ap.add_argument("--block-bytes", type=int, default=2 * MiB)
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args(argv)
    n, size = args.blocks, args.block_bytes
    total = n * size
    host = np.random.default_rng(1).integers(0, 256, (n, size), dtype=np.uint8)
    out = dict(blocks=n, block_bytes=size)
    host_dst = np.empty_like(host)
    out["host_xxh64_gbps"] = round(
        best_gbps(lambda: [cks.checksum(r) for r in host], total, args.reps), 2
    )
    out["host_memcpy_gbps"] = round(
        best_gbps(lambda: np.copyto(host_dst, host), total, args.reps), 2
    )
    if not torch.cuda.is_available():
        out.update(
            device="cpu",
            device_hash_gbps=None,
            limit_gbps=None,
            hash_ratio=None,
            h2d_gbps=None,
            note="no CUDA device: host figures only",
        )
        print(json.dumps(out))
        return 0
    dev = torch.device("cuda:0")
    if not device_hash.available(dev):
        print(f"no device hash: {device_hash.why_not()}", file=sys.stderr)
        return 2
    pool = torch.from_numpy(host).to(dev)
    copy = torch.empty_like(pool)
    slots = list(range(n))
    sync = torch.cuda.synchronize
    digests = device_hash.slot_digests(pool, slots, size)
    if digests != [cks.checksum(r) for r in host]:
        print("device digests differ from the host's XXH64", file=sys.stderr)
        return 1
    out["device"] = torch.cuda.get_device_name(dev)
    out["device_hash_gbps"] = round(
        best_gbps(lambda: device_hash.slot_digests(pool, slots, size), total, args.reps, sync), 2
    )
    # As a receiver hashes: one message (MESSAGE_BYTES, 8 blocks of 2 MiB) per launch, from
    # worker threads as messages land (each thread on its own stream), 8 at a time.
    per = max(1, min(n, MESSAGE_BYTES // size))
    groups = [slots[i : i + per] for i in range(0, n, per)]
    out["message_blocks"] = per
    out["device_hash_message_gbps"] = round(
        best_gbps(
            lambda: device_hash.slot_digests(pool, groups[0], size), per * size, args.reps, sync
        ),
        2,
    )
    with ThreadPoolExecutor(len(groups)) as ex:
        out["device_hash_threads_gbps"] = round(
            best_gbps(
                lambda: list(ex.map(lambda g: device_hash.slot_digests(pool, g, size), groups)),
                total,
                args.reps,
                sync,
            ),
            2,
        )
    out["limit_gbps"] = round(best_gbps(lambda: copy.copy_(pool), total, args.reps, sync), 2)
    out["hash_ratio"] = round(out["device_hash_gbps"] / out["limit_gbps"], 3)
    src = torch.from_numpy(host)
    out["h2d_gbps"] = round(best_gbps(lambda: copy.copy_(src), total, args.reps, sync), 2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
