"""The native hot path and its fallback, in one place.

This folder holds the C sources of the extension ``kvstore._native`` (setup.py builds
it): ``blake2b.c`` and ``blake2b_avx2.c`` (block ids), ``xxh64.c`` (payload checksums),
``copy.c`` (non-temporal copies and the fused copy+checksum), ``idtable.c`` (the router
index's id table; router/idtable.py holds its fallback), ``paged.c`` (copies between
kvstore blocks and vLLM's paged CPU KV cache; kvstore/integrations/vllm_layout.py holds
its torch fallback), ``module.c`` (the CPython glue).
``load()`` is how kvstore.hashing and kvstore.checksum get the extension, or
``None`` for their pure-Python fallbacks (bit-identical, several times slower): a
fallback is never silent, it logs a warning once per process and ``active()`` names it
(the agent's Stats report it as ``native_accel``; ``python -m kvstore.native`` prints it).
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from types import ModuleType

from kvstore.native.required import OPTIONAL_ENV, RULE, must_build

log = logging.getLogger("kvstore.native")

EXTENSION = "kvstore._native"
OFF_ENV = "KVSTORE_NO_NATIVE"  # force the fallback (the tests compare both paths)
_warned: set[str] = set()
_first: Accel | None = None  # what the process's first load() returned

__all__ = ["Accel", "EXTENSION", "OFF_ENV", "OPTIONAL_ENV", "RULE", "active", "load", "must_build"]


@dataclass(frozen=True, slots=True)
class Accel:
    """What a module hashes and checksums with: the extension, or None and why not."""

    module: ModuleType | None
    reason: str = ""  # why the fallback is in use; empty with the extension

    @property
    def name(self) -> str:
        """'native avx2', 'native scalar' or 'python (<why>)'."""
        if self.module is None:
            return f"python ({self.reason})"
        return "native avx2" if getattr(self.module, "HAVE_AVX2", False) else "native scalar"


def _import() -> Accel:
    if os.environ.get(OFF_ENV, "").strip() not in ("", "0"):
        return Accel(None, f"disabled by {OFF_ENV}")
    try:
        return Accel(importlib.import_module(EXTENSION))
    except ModuleNotFoundError as exc:
        if exc.name == EXTENSION:
            return Accel(None, f"{EXTENSION} is not built")
        return Accel(None, f"{EXTENSION} does not import: {exc}")
    except ImportError as exc:  # built, but for another Python or with a missing symbol
        return Accel(None, f"{EXTENSION} does not import: {exc}")


def load() -> Accel:
    """The extension unless $KVSTORE_NO_NATIVE is set; read at each call, so a module
    re-executed with it set gets the fallback. A fallback is logged once per reason."""
    global _first
    accel = _import()
    if _first is None:
        _first = accel
    if accel.module is None and accel.reason not in _warned:
        _warned.add(accel.reason)
        how = (
            "unset it for the native code"
            if accel.reason.startswith("disabled")
            else "rebuild with `make install` or `pip install -e .`"
        )
        log.warning(
            "kvstore hashing and checksums use the pure-Python fallback (several "
            "times slower): %s; %s",
            accel.reason,
            how,
        )
    return accel


def active() -> str:
    """What this process hashes and checksums with (Stats' native_accel): what the first
    load() got, i.e. kvstore.hashing and kvstore.checksum at import (under one
    environment: both or neither), never changed later."""
    return (_first or _import()).name
