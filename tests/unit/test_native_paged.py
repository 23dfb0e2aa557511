"""The native copies between kvstore blocks and vLLM's paged CPU cache
(kvstore/native/paged.c): they write and read exactly the bytes of the layout's
definition, and every argument is checked before a byte moves."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import native

_native = native.load().module
pytestmark = pytest.mark.skipif(_native is None, reason="kvstore._native is not built")

LAYERS, HEADS, BS, ROW, NUM_BLOCKS = 3, 2, 4, 8, 6  # ROW: bytes of one head_dim row


def _caches(rng) -> list[np.ndarray]:
    shape = (NUM_BLOCKS, HEADS, 2, BS, ROW)  # vLLM CPU: (blocks, heads, K/V, tokens, row)
    return [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(LAYERS)]


def _reference(caches, ids) -> np.ndarray:
    """kvstore blocks (n, layers, K/V, tokens, heads, row) of cache blocks `ids`."""
    return np.stack([np.stack([c[b].transpose(1, 2, 0, 3) for c in caches]) for b in ids])


def _args(caches, ids, blocks):
    return caches, ids, blocks, BS, HEADS, ROW


def test_gather_and_scatter_move_the_layouts_bytes():
    rng = np.random.default_rng(1)
    caches = _caches(rng)
    ids = [4, 0, np.int64(5), 2]  # numpy's integers are integers too
    out = np.empty((len(ids), LAYERS, 2, BS, HEADS, ROW), dtype=np.uint8)
    _native.paged_gather(*_args(caches, ids, out))
    assert np.array_equal(out, _reference(caches, ids))
    fresh = [np.zeros_like(c) for c in caches]
    _native.paged_scatter(*_args(fresh, ids, out))
    for src, dst in zip(caches, fresh):
        assert np.array_equal(dst[ids], src[ids])
        assert not dst[[1, 3]].any()  # blocks not named are untouched


def test_arguments_are_checked_before_anything_is_copied():
    rng = np.random.default_rng(2)
    caches = _caches(rng)
    before = [c.copy() for c in caches]
    one = np.ones((1, LAYERS, 2, BS, HEADS, ROW), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"block_ids\[0\] is 6, not a block in \[0, 6\)"):
        _native.paged_scatter(*_args(caches, [6], one))
    with pytest.raises(ValueError, match=r"block_ids\[1\] is -1"):
        _native.paged_scatter(*_args(caches, [0, -1], np.ones((2, *one.shape[1:]), np.uint8)))
    with pytest.raises(ValueError, match=r"block_ids\[0\] is True"):
        _native.paged_scatter(*_args(caches, [True], one))
    with pytest.raises(ValueError, match="not 2 blocks"):
        _native.paged_scatter(*_args(caches, [0, 1], one))
    with pytest.raises(ValueError, match="not whole blocks"):
        _native.paged_scatter(*_args([caches[0].reshape(-1)[:-8]], [0], one))
    with pytest.raises(ValueError, match="C-contiguous"):
        _native.paged_scatter(*_args([caches[0][:, :1]], [0], one))
    readonly = caches[1].copy()
    readonly.flags.writeable = False
    with pytest.raises(TypeError, match="writable"):
        _native.paged_scatter(*_args([caches[0], readonly, caches[2]], [0], one))
    with pytest.raises(ValueError, match="overlaps"):
        _native.paged_scatter(caches, [0], caches[0].reshape(-1)[: one.size], BS, HEADS, ROW)
    with pytest.raises(ValueError, match="caches is empty"):
        _native.paged_scatter(*_args([], [], one[:0]))
    for c, b in zip(caches, before):
        assert np.array_equal(c, b)
    with pytest.raises(TypeError, match="writable"):  # gather writes the blocks
        frozen = one.copy()
        frozen.flags.writeable = False
        _native.paged_gather(*_args(caches, [0], frozen))
