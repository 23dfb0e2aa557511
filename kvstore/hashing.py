"""Block identity: the one hashing module used by agents, routers and clients.

Definition
----------
A prompt is cut into blocks of ``block_size`` tokens; only FULL blocks get an
id (a partial tail block is never cached).  Block ``i`` has the id::

    id_i = BLAKE2b(digest_size=16, unkeyed)(id_{i-1} || canon(block_i) || extra)
    id_{-1} = root

where

* ``canon(block)`` is the canonical token encoding: each token as a signed
  32-bit little-endian integer, concatenated (``tokens_to_bytes``).  The same
  token ids therefore hash identically whether they arrive as a Python list,
  a numpy array of any integer dtype or a torch tensor.
* ``extra`` is an optional byte string appended to every block (e.g. a model
  or LoRA / multimodal discriminator); it is the same for all blocks of a
  chain.
* ``root`` is a 16-byte chain root.  Roots are derived and keyed per tenant
  elsewhere (see the namespace module), so identical prompts of different
  tenants never share ids.

Because each id covers its parent id, an id names the whole prefix up to and
including its block, which is what prefix-cache lookup needs.

Why BLAKE2b-128
---------------
Block ids are used as cache keys shared between tenants' requests on the same
node, so a collision would serve one prompt's KV cache for another.  A
non-cryptographic hash (xxHash, CityHash, Python ``hash``) can be attacked: a
crafted prompt could be made to collide with a victim's chain.  BLAKE2b is a
cryptographic hash; at 128 bits finding any collision takes ~2**64 work and a
second preimage ~2**128, while ids stay small (16 bytes) and fast to compute.
The bytes hashed are exactly ``parent + canon(tokens) + extra`` with no other
framing; that is unambiguous because the parent is always 16 bytes, every
block of a chain has the same length and ``extra`` is fixed per chain.

``hash_block`` is the reference definition (pure ``hashlib``).  ``hash_chain``
and ``hash_chain_packed`` use the C extension ``kvstore._native`` when it is
importable (``NATIVE``) and an equivalent ``hashlib`` loop otherwise; both
produce bit-identical output.  Set ``KVSTORE_NO_NATIVE=1`` to force the
fallback; ``kvstore.native.load`` logs a fallback and ``ACCEL`` names it.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from struct import Struct
from typing import Any, Iterable, List, NewType, Union

from kvstore import native

BlockId = NewType("BlockId", bytes)
BLOCK_ID_BYTES = 16

_INT32_MIN = -(2**31)
_INT32_MAX = 2**31 - 1

ACCEL = native.load()  # the extension, or None and why (logged)
_native = ACCEL.module
NATIVE: bool = _native is not None

TokensLike = Any  # list/tuple/range of int, numpy int array, torch int tensor, bytes

__all__ = [
    "BlockId",
    "BLOCK_ID_BYTES",
    "NATIVE",
    "tokens_to_bytes",
    "hash_block",
    "hash_chain",
    "hash_chain_packed",
    "split_ids",
    "pack_ids",
    "BlockIds",
]


# --------------------------------------------------------------------------
# Canonical token bytes
# --------------------------------------------------------------------------


def _numpy_to_bytes(arr: Any) -> Union[bytes, memoryview]:
    import numpy as np

    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tuple(arr.shape)}")
    kind = arr.dtype.kind
    if kind not in "iu":
        raise ValueError(f"tokens must have an integer dtype, got {arr.dtype}")
    if arr.size and (arr.dtype.itemsize > 4 or (kind == "u" and arr.dtype.itemsize == 4)):
        lo, hi = int(arr.min()), int(arr.max())
        if lo < _INT32_MIN or hi > _INT32_MAX:
            raise ValueError(f"token ids must fit in int32, got range [{lo}, {hi}]")
    if arr.dtype == np.dtype("<i4") and arr.flags.c_contiguous:
        return memoryview(arr).cast("B")  # zero-copy
    return arr.astype("<i4").tobytes()


def _torch_to_bytes(t: Any, torch_mod: Any) -> Union[bytes, memoryview]:
    if t.device.type != "cpu":
        raise ValueError(f"tokens tensor must be on the CPU, got device {t.device}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch_mod.bool:
        raise ValueError(f"tokens must have an integer dtype, got {t.dtype}")
    return _numpy_to_bytes(t.detach().contiguous().numpy())


def tokens_to_bytes(tokens: TokensLike) -> Union[bytes, memoryview]:
    """Canonical encoding of token ids: signed int32, little-endian, packed.

    Accepts a list/tuple/range of ints, a 1-D numpy integer array, a 1-D CPU
    torch integer tensor, or already-encoded bytes (``bytes``/``bytearray``/
    ``memoryview`` whose length is a multiple of 4).  Raises ``ValueError``
    for ids outside int32, non-integer dtypes or a bad byte length, and
    ``TypeError`` for unsupported container types.
    """
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        mv = memoryview(tokens)
        if mv.format not in ("B", "b", "c") or not mv.c_contiguous:
            raise ValueError(
                f"token bytes must be a contiguous byte buffer, got format {mv.format!r}"
            )
        if mv.nbytes % 4:
            raise ValueError(f"token bytes length must be a multiple of 4, got {mv.nbytes}")
        if isinstance(tokens, bytearray):
            return bytes(tokens)  # snapshot: a bytearray may change later
        return tokens if isinstance(tokens, bytes) else mv.cast("B")
    np_mod = sys.modules.get("numpy")
    if np_mod is not None and isinstance(tokens, np_mod.ndarray):
        return _numpy_to_bytes(tokens)
    torch_mod = sys.modules.get("torch")
    if torch_mod is not None and isinstance(tokens, torch_mod.Tensor):
        return _torch_to_bytes(tokens, torch_mod)
    if isinstance(tokens, (list, tuple, range)):
        try:
            arr = array("i", tokens)
        except OverflowError as exc:
            raise ValueError(f"token ids must fit in int32: {exc}") from None
        except TypeError as exc:
            raise ValueError(f"token ids must be integers: {exc}") from None
        if arr.itemsize != 4:  # pragma: no cover - exotic C int size
            import numpy as np

            return _numpy_to_bytes(np.asarray(tokens, dtype=np.int64))
        if sys.byteorder != "little":  # pragma: no cover
            arr.byteswap()
        return arr.tobytes()
    raise TypeError(
        "tokens must be a list/tuple of ints, a numpy array, a torch tensor or "
        f"bytes, not {type(tokens).__name__!r}"
    )


# --------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------


def _check_id(value: Any, what: str) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"{what} must be bytes, not {type(value).__name__!r}")
    value = bytes(value)
    if len(value) != BLOCK_ID_BYTES:
        raise ValueError(f"{what} must be {BLOCK_ID_BYTES} bytes, got {len(value)}")
    return value


def _check_extra(extra: Any) -> bytes:
    if not isinstance(extra, (bytes, bytearray, memoryview)):
        raise TypeError(f"extra must be bytes, not {type(extra).__name__!r}")
    return bytes(extra)


def _check_block_size(block_size: Any) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int, not {type(block_size).__name__!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return block_size


# --------------------------------------------------------------------------
# Hashing
# --------------------------------------------------------------------------


def hash_block(parent: BlockId, tokens: TokensLike, extra: bytes = b"") -> BlockId:
    """Reference definition: BLAKE2b-128(parent || canon(tokens) || extra)."""
    data = tokens_to_bytes(tokens)
    h = hashlib.blake2b(_check_id(parent, "parent"), digest_size=BLOCK_ID_BYTES)
    h.update(data)
    h.update(_check_extra(extra))
    return BlockId(h.digest())


def _py_chain_packed(
    root: bytes, data: Union[bytes, memoryview], block_size: int, extra: bytes
) -> bytes:
    """hashlib implementation of the chain over canonical token bytes."""
    step = block_size * 4
    n_blocks = len(data) // step
    mv = memoryview(data).cast("B")
    out = bytearray(n_blocks * BLOCK_ID_BYTES)
    parent = root
    blake2b = hashlib.blake2b
    for i in range(n_blocks):
        h = blake2b(parent, digest_size=BLOCK_ID_BYTES)
        h.update(mv[i * step : (i + 1) * step])
        h.update(extra)
        parent = h.digest()
        out[i * BLOCK_ID_BYTES : (i + 1) * BLOCK_ID_BYTES] = parent
    return bytes(out)


def _prepare(root: Any, tokens: TokensLike, block_size: Any, extra: Any):
    return (
        _check_id(root, "root"),
        tokens_to_bytes(tokens),
        _check_block_size(block_size),
        _check_extra(extra),
    )


def py_hash_chain_packed(
    root: bytes, tokens: TokensLike, block_size: int, extra: bytes = b""
) -> bytes:
    """Pure-Python ``hash_chain_packed`` (the fallback; always available)."""
    return _py_chain_packed(*_prepare(root, tokens, block_size, extra))


def hash_chain_packed(
    root: bytes, tokens: TokensLike, block_size: int, extra: bytes = b""
) -> bytes:
    """Ids of all full blocks of ``tokens``, concatenated (16 bytes each).

    A trailing partial block is ignored.  ``root`` must be 16 bytes and
    ``block_size`` >= 1.
    """
    args = _prepare(root, tokens, block_size, extra)
    if _native is not None:
        return _native.chain_hash(*args)
    return _py_chain_packed(*args)


def hash_chain(root: bytes, tokens: TokensLike, block_size: int, extra: bytes = b"") -> "BlockIds":
    """Ids of all full blocks of ``tokens`` (see ``hash_chain_packed``), as a list that
    keeps its packed form for the requests that carry it."""
    return BlockIds(hash_chain_packed(root, tokens, block_size, extra))


def py_hash_chain(
    root: bytes, tokens: TokensLike, block_size: int, extra: bytes = b""
) -> List[BlockId]:
    """Pure-Python ``hash_chain`` (the fallback; always available)."""
    return split_ids(py_hash_chain_packed(root, tokens, block_size, extra))


# --------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------


def split_ids(packed: Union[bytes, bytearray, memoryview]) -> List[BlockId]:
    """Split concatenated 16-byte ids into a list."""
    if not isinstance(packed, (bytes, bytearray, memoryview)):
        raise TypeError(f"packed ids must be bytes, not {type(packed).__name__!r}")
    if not isinstance(packed, bytes):
        packed = bytes(packed)
    if len(packed) % BLOCK_ID_BYTES:
        raise ValueError(
            f"packed ids length must be a multiple of {BLOCK_ID_BYTES}, got {len(packed)}"
        )
    # One uncached Struct of n "16s" fields is ~4x faster than slicing in a
    # Python loop; BlockId is a NewType (identity at runtime).
    return list(Struct("16s" * (len(packed) // BLOCK_ID_BYTES)).unpack(packed))


class BlockIds(list):
    """A list of 16-byte ids that remembers their concatenation, so the Lookup, Get and
    Route of a prompt send hash_chain's packed output instead of joining and
    length-checking every id again (that costs more than the Lookup itself on a
    small host). Contiguous slices keep it; any change in place drops it."""

    __slots__ = ("packed",)

    def __init__(self, packed: Union[bytes, bytearray, memoryview] = b"") -> None:
        super().__init__(split_ids(packed))
        self.packed: bytes | None = bytes(packed)

    def __getitem__(self, key):
        if not isinstance(key, slice):
            return list.__getitem__(self, key)
        start, stop, step = key.indices(len(self))
        if step != 1 or self.packed is None:
            return list.__getitem__(self, key)
        out = BlockIds.__new__(BlockIds)
        list.extend(out, list.__getitem__(self, key))
        stop = max(start, stop)
        out.packed = self.packed[start * BLOCK_ID_BYTES : stop * BLOCK_ID_BYTES]
        return out

    def __reduce__(self):
        return list, (list(self),)


def _forgetting(name: str):
    base = getattr(list, name)

    def method(self, *args):
        self.packed = None
        return base(self, *args)

    method.__name__ = name
    return method


for _name in (
    "__setitem__",
    "__delitem__",
    "__iadd__",
    "__imul__",
    "append",
    "extend",
    "insert",
    "pop",
    "remove",
    "clear",
    "sort",
    "reverse",
):
    setattr(BlockIds, _name, _forgetting(_name))


def pack_ids(ids: Iterable[bytes]) -> bytes:
    """Concatenate 16-byte ids; every id is length-checked (in C via join/map: a
    2,000-id prompt packs in tens of microseconds, it sits on every Lookup). A BlockIds
    from hash_chain is already packed."""
    if type(ids) is BlockIds and ids.packed is not None:
        return ids.packed
    ids = ids if isinstance(ids, list) else list(ids)
    try:
        packed = b"".join(ids)
        lengths_ok = set(map(len, ids)) <= {BLOCK_ID_BYTES}
    except TypeError:
        packed, lengths_ok = b"", False
    if lengths_ok:
        return packed
    for i, block_id in enumerate(ids):  # slow path: name the offending id
        if not isinstance(block_id, (bytes, bytearray, memoryview)):
            raise TypeError(f"id #{i} must be bytes, not {type(block_id).__name__!r}")
        if len(bytes(block_id)) != BLOCK_ID_BYTES:
            raise ValueError(f"id #{i} must be {BLOCK_ID_BYTES} bytes, got {len(bytes(block_id))}")
    return b"".join(bytes(b) for b in ids)
