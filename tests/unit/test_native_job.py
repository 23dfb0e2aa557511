"""copy_checksum_start: the batch copy run in the background for a caller on an event
loop (the agent's big shared-memory Puts and Gets, node_agent/servicer.py). The same
digests as the foreground batch and the xxhash package, every buffer checked before a
byte is copied, the eventfd readable only once all is done, the buffers held until the
result is taken, and nothing leaked (threads, descriptors) however the job ends."""

from __future__ import annotations

import asyncio
import os
import select
import threading
import time

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as hs
from support.common import python_json

from kvstore import checksum as cks

try:
    from kvstore import _native
except ImportError:  # pragma: no cover - extension not built
    _native = None

pytestmark = pytest.mark.skipif(_native is None, reason="kvstore._native not built")
MiB = 1 << 20


def _blocks(seed: int, sizes: list[int]):
    rng = np.random.default_rng(seed)
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    dsts = [np.full(n + 5, 0xAB, dtype=np.uint8) for n in sizes]
    return srcs, dsts


def _readable(fd: int, timeout: float) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@settings(max_examples=40, deadline=None)
@given(
    sizes=hs.lists(hs.integers(0, 600_000), max_size=8),
    threads=hs.integers(1, 6),
    seed=hs.integers(0, 2**32 - 1),
)
def test_background_batch_gives_the_foreground_digests(sizes, threads, seed):
    srcs, dsts = _blocks(seed, sizes)
    job = cks.copy_with_checksum_start(dsts, srcs, threads)
    assert _readable(job.fileno(), 30)
    assert job.done()
    got = job.result()
    assert got == [xxhash.xxh64_intdigest(s.tobytes()) for s in srcs]
    assert got == cks.copy_with_checksum_many([np.empty_like(s) for s in srcs], srcs, threads)
    for s, d in zip(srcs, dsts):
        assert np.array_equal(d[: s.size], s)
        assert (d[s.size :] == 0xAB).all()  # nothing past the source's length
    assert job.result() == got  # the same list again


def test_the_descriptor_turns_readable_only_when_every_copy_is_done():
    srcs, dsts = _blocks(1, [8 * MiB] * 8)  # long enough to be caught in flight
    seen_in_flight = 0
    for _ in range(5):  # a loaded host may not run this thread again before the end
        job = cks.copy_with_checksum_start(dsts, srcs, 2)
        fd = job.fileno()
        looked = False
        while not _readable(fd, 0):
            looked = True
        seen_in_flight += looked
        assert job.done()  # readable: every thread is past its last copy
        assert os.eventfd_read(fd) == 1  # written once, by the last thread out
        assert job.result() == [xxhash.xxh64_intdigest(s.tobytes()) for s in srcs]
    assert seen_in_flight  # 64 MiB take far longer than one look, mostly


def test_result_closes_the_descriptor_and_lets_go_of_the_buffers():
    src = bytearray(os.urandom(4 * MiB))
    dst = bytearray(4 * MiB)
    before = _open_fds()
    job = cks.copy_with_checksum_start([memoryview(dst)], [memoryview(src)], 2)
    assert _open_fds() == before + 1
    with pytest.raises(BufferError):  # held by the job while it may still copy
        dst.extend(b"x")
    job.result()
    assert _open_fds() == before
    with pytest.raises(ValueError, match="no descriptor left"):
        job.fileno()
    dst.extend(b"x")  # released: the buffer may be resized again
    assert bytes(dst[: len(src)]) == bytes(src)


def _take(job, got: list) -> None:
    got.append(job.result())


def test_results_taken_from_several_threads_at_once_join_once_and_agree():
    srcs, dsts = _blocks(4, [4 * MiB] * 8)
    for _ in range(10):
        job = cks.copy_with_checksum_start(dsts, srcs, 2)
        got: list = []
        takers = [threading.Thread(target=_take, args=(job, got)) for _ in range(4)]
        for t in takers:
            t.start()
        for t in takers:
            t.join()
        assert len(got) == 4 and all(g == got[0] for g in got)
    assert got[0] == [xxhash.xxh64_intdigest(s.tobytes()) for s in srcs]


class _AsksOnItsEnd:
    """Garbage in a cycle that, when collected, takes the job's result itself."""

    def __init__(self, job, got: list) -> None:
        self.job, self.got = job, got
        self.other: _AsksOnItsEnd | None = None

    def __del__(self) -> None:
        self.got.append(self.job.result())


def test_a_result_asked_from_a_finalizer_while_the_first_is_made_gives_the_same():
    """result() builds its list, which may collect garbage, whose finalizer may ask the
    same job's result() meanwhile: both get the digests (the outer once returned a list
    of empty slots, a crash on first use)."""
    import gc

    srcs, dsts = _blocks(6, [MiB] * 4)
    job = _native.copy_checksum_start(dsts, srcs, 2)
    assert _readable(job.fileno(), 30)
    inner: list = []
    gc.collect()
    gc.disable()
    try:
        drained = [[] for _ in range(500)]  # the list free list empty: the next list is
        a, b = _AsksOnItsEnd(job, inner), _AsksOnItsEnd(job, inner)  # a new object
        a.other, b.other = b, a
        del a, b
        threshold = gc.get_threshold()
        gc.set_threshold(1)
        gc.enable()
        try:
            outer = job.result()
        finally:
            gc.set_threshold(*threshold)
    finally:
        gc.enable()
    del drained
    assert inner, "no finalizer ran inside result(): the case was not made"
    want = [xxhash.xxh64_intdigest(s.tobytes()) for s in srcs]
    assert outer == want and all(got == want for got in inner)
    assert all(np.array_equal(s, d[: s.size]) for s, d in zip(srcs, dsts))


def test_a_child_forked_while_a_job_runs_gets_an_error_not_a_result():
    """In a forked child the job's threads do not exist and its copies are incomplete:
    result() raises there; the parent's result is whole."""
    srcs, dsts = _blocks(7, [8 * MiB] * 8)
    job = _native.copy_checksum_start(dsts, srcs, 2)
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if result() refused
        code = 1
        try:
            job.result()
        except RuntimeError as exc:
            code = 0 if "another process" in str(exc) else 2
        finally:
            os._exit(code)
    assert job.result() == [xxhash.xxh64_intdigest(s.tobytes()) for s in srcs]
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


_DROPPED_UNFINISHED = """
import json, os, sys
import numpy as np
from kvstore import checksum as cks
def counts():
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))
rng = np.random.default_rng(2)
before = counts()
for _ in range(20):
    srcs = [rng.integers(0, 256, 2 << 20, dtype=np.uint8) for _ in range(8)]
    dsts = [np.full((2 << 20) + 5, 0xAB, dtype=np.uint8) for _ in range(8)]
    job = cks.copy_with_checksum_start(dsts, srcs, 3)
    del job  # its end joins the threads before the buffers go
    if not all(np.array_equal(d[: s.size], s) for s, d in zip(srcs, dsts)):
        sys.exit("a copy was not whole when its job ended")
print(json.dumps({"before": before, "after": counts()}))
"""


def test_a_job_dropped_unfinished_waits_for_its_threads_and_leaks_nothing():
    """In a process of its own: in the test process, threads other tests left behind
    (a gRPC channel's, an event loop's) open and close descriptors of their own."""
    seen = python_json("-c", _DROPPED_UNFINISHED)
    assert seen["after"] == seen["before"], seen  # [descriptors, threads]


@pytest.mark.parametrize(
    "dsts, srcs, error, match",
    [
        ([bytearray(8)], [b"a" * 8, b"b" * 8], ValueError, "1 dsts for 2 srcs"),
        ([b"x" * 8], [b"a" * 8], TypeError, r"dsts\[0\] must be a writable buffer"),
        ([bytearray(8), bytearray(4)], [b"a" * 8] * 2, ValueError, r"dsts\[1\] is too small"),
        ([bytearray(8)], [3], TypeError, r"srcs\[0\] must be a bytes-like object"),
        (5, [b"a"], TypeError, "dsts must be a sequence"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_copied(dsts, srcs, error, match):
    before = _open_fds()
    firsts = [bytes(d) for d in dsts] if isinstance(dsts, list) else None
    with pytest.raises(error, match=match):
        cks.copy_with_checksum_start(dsts, srcs, 2)
    if firsts is not None:
        assert [bytes(d) for d in dsts] == firsts
    assert _open_fds() == before


@pytest.mark.parametrize("threads", [0, 65, True, "2"])
def test_thread_counts_out_of_range_are_refused(threads):
    with pytest.raises((ValueError, TypeError), match="threads"):
        cks.copy_with_checksum_start([bytearray(4)], [b"abcd"], threads)


def test_an_event_loop_waits_on_the_job_without_a_thread_of_its_own():
    srcs, dsts = _blocks(3, [8 * MiB] * 4)

    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        job = cks.copy_with_checksum_start(dsts, srcs, 2)
        done = loop.create_future()
        loop.add_reader(job.fileno(), lambda: done.done() or done.set_result(None))
        try:
            await asyncio.wait_for(done, 30)
        finally:
            loop.remove_reader(job.fileno())
        return job.result()

    assert asyncio.run(main()) == [xxhash.xxh64_intdigest(s.tobytes()) for s in srcs]


def test_without_the_extension_there_is_no_background_job(monkeypatch):
    monkeypatch.setattr(cks, "_native", None)
    assert cks.copy_with_checksum_start([bytearray(4)], [b"abcd"], 2) is None


def test_copies_not_begun_by_the_deadline_are_not_made():
    """deadline_ns (CLOCK_MONOTONIC): a job begun after it is skipped, its destination
    left as it was and its digest None; one begun before it is whole. Past already:
    nothing is copied."""
    sizes = [256 << 10] * 160  # 40 MiB in 256 KiB jobs
    srcs, dsts = _blocks(7, sizes)
    job = cks.copy_with_checksum_start(dsts, srcs, 1, deadline_ns=time.monotonic_ns())
    assert _readable(job.fileno(), 30)
    assert job.result() == [None] * len(sizes)
    assert all((d == 0xAB).all() for d in dsts)
    # A deadline half-way through what the whole batch takes on this host (timed on
    # destinations already touched, as the runs below have): some jobs made, the rest
    # not, each one whole or untouched.
    want = [xxhash.xxh64_intdigest(s.tobytes()) for s in srcs]
    spare = [np.full(n, 1, dtype=np.uint8) for n in sizes]
    took = 0
    for _ in range(2):
        t = time.monotonic_ns()
        whole = cks.copy_with_checksum_start(spare, srcs, 1)
        assert _readable(whole.fileno(), 30)
        assert whole.result() == want
        took = time.monotonic_ns() - t
    offset = took // 2
    for _ in range(20):
        srcs, dsts = _blocks(7, sizes)
        job = cks.copy_with_checksum_start(dsts, srcs, 1, deadline_ns=time.monotonic_ns() + offset)
        assert _readable(job.fileno(), 30)
        got = job.result()
        for g, w, s, d in zip(got, want, srcs, dsts):
            if g is None:
                assert (d == 0xAB).all()
            else:
                assert g == w and np.array_equal(d[: len(s)], s)
        if None not in got:  # all done in time: the host ran faster than timed
            offset //= 2
        elif all(g is None for g in got):  # none begun: slower
            offset *= 2
        else:
            break
    else:
        pytest.fail("no run stopped part-way at a deadline set mid-batch")


@pytest.mark.parametrize("bad", [-1, 2**64, "soon", True])
def test_a_deadline_that_is_no_clock_time_is_refused_before_any_copy(bad):
    srcs, dsts = _blocks(8, [4096])
    with pytest.raises((TypeError, ValueError), match="deadline_ns"):
        cks.copy_with_checksum_start(dsts, srcs, 1, deadline_ns=bad)
    assert (dsts[0] == 0xAB).all()
