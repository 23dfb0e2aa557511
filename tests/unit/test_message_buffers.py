"""kvstore.heap.keep_message_buffers' bounds: what it asks of glibc is accepted whatever
the size it is given (the behaviour it buys is in integration/test_grpc_message_memory.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.parametrize("largest", [1, 16 << 20, 1 << 30])
def test_any_size_is_brought_within_what_glibc_accepts(largest):
    # A fresh interpreter: the setting is process-wide and must not leak into other tests.
    code = f"from kvstore.heap import keep_message_buffers as k; print(k({largest}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
