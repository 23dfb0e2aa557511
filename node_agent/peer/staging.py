"""Host staging buffers of peer transfer, and the memory layout of payloads: which pool
slots or buffers lie back to back, so that a run of blocks travels as one message."""

from __future__ import annotations

import numpy as np

OFFLOAD_BYTES = 1 << 20  # store copies at least this large run in a worker thread


class StagingPool:
    """Reusable block buffers, carved in sets from one array each so UCX registers the
    memory once and its registration cache keeps it. A set's pages are only touched by
    the payloads that really pass through it (blocks served from NVMe, receives into
    fragmented slots); idle sets are kept up to `max_idle_bytes` in all."""

    def __init__(self, max_idle_bytes: int = 512 << 20) -> None:
        self._idle: dict[tuple[int, int], list[list[np.ndarray]]] = {}
        self._max_idle = max_idle_bytes
        self._idle_bytes = 0

    def take(self, n: int, nbytes: int) -> list[np.ndarray]:
        idle = self._idle.get((n, nbytes))
        if idle:
            self._idle_bytes -= n * nbytes
            return idle.pop()
        arena = np.empty(n * nbytes, dtype=np.uint8)
        return [arena[i * nbytes : (i + 1) * nbytes] for i in range(n)]

    def give(self, bufs: list[np.ndarray]) -> None:
        size = len(bufs) * bufs[0].nbytes
        if self._idle_bytes + size <= self._max_idle:
            self._idle.setdefault((len(bufs), bufs[0].nbytes), []).append(bufs)
            self._idle_bytes += size

    def lease(self, n_sets: int, batch: int, nbytes: int) -> "StagingLease":
        return StagingLease(self, [self.take(batch, nbytes) for _ in range(n_sets)])


class StagingLease:
    """The buffer sets of one transfer, used round-robin (`lease[k]` for batch k). They go
    back to the pool only while `clean`: a failed transfer may leave a UCX receive, a send
    or a worker-thread copy still touching them, and such sets are dropped instead."""

    def __init__(self, pool: StagingPool, sets: list[list[np.ndarray]]) -> None:
        self.pool = pool
        self.sets = sets
        self.clean = True

    def __getitem__(self, k: int) -> list[np.ndarray]:
        return self.sets[k % len(self.sets)]

    def release(self) -> None:
        if self.clean:
            for s in self.sets:
                self.pool.give(s)
        self.sets = []


def contiguous(bufs: list[np.ndarray], n: int) -> np.ndarray:
    """The first n buffers of a staging set as one array: StagingPool.take carves a set
    in order from one arena, so they lie back to back."""
    base = bufs[0].base
    if base is None:
        raise ValueError("staging buffers are views of one arena (StagingPool.take)")
    return base[: n * bufs[0].nbytes]


def _where(buf) -> tuple[int, bool]:
    """(address, one byte per element) of a slot view or staging buffer: a 1-D uint8 host
    array, or a 1-D uint8 torch tensor (device pools' slot views)."""
    if isinstance(buf, np.ndarray):
        return buf.__array_interface__["data"][0], buf.strides == (1,)
    return buf.data_ptr(), tuple(buf.stride()) == (1,)


def runs_of(bufs: list, size: int, cap: int = 0) -> list[int]:
    """Lengths of the runs of `bufs` (1-D uint8 arrays or tensors of at least `size`
    bytes) that lie back to back in memory: each next one starting `size` bytes after the
    previous; at most `cap` buffers each when cap > 0. Pool slots reserved or filled one
    after another usually do, and such a run travels over UCX as one message (one
    completion, one round of thread hand-offs) instead of one each."""
    runs: list[int] = []
    prev = None
    for b in bufs:
        addr, dense = _where(b)
        if prev is not None and addr == prev + size and dense and (cap <= 0 or runs[-1] < cap):
            runs[-1] += 1
        else:
            runs.append(1)
        prev = addr
    return runs


def spans(bufs: list, runs: list[int], size: int) -> list | None:
    """One array (tensor, for tensors) per run over `size` bytes of each of its buffers,
    or None when some run's buffers do not lie back to back (runs_of decides). A span
    covers memory that belongs to the run's own buffers, which the caller keeps referenced
    while the span is in use."""
    out: list = []
    where = [_where(b) for b in bufs]  # once each: ~3 us a buffer, 64 a chunk
    i = 0
    for r in runs:
        part = bufs[i : i + r]
        start = where[i][0]
        if len(part) != r or not all(
            dense and addr == start + k * size for k, (addr, dense) in enumerate(where[i : i + r])
        ):
            return None
        first = part[0]
        if r == 1:
            out.append(first[:size])
        elif isinstance(first, np.ndarray):
            out.append(
                np.lib.stride_tricks.as_strided(
                    first, shape=(r * size,), strides=(1,), writeable=first.flags.writeable
                )
            )
        else:  # a tensor: the same storage, r slots long
            out.append(first.as_strided((r * size,), (1,)))
        i += r
    return out
