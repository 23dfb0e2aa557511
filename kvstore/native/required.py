"""Where the extension kvstore._native must build. setup.py loads this file by path
(before kvstore is installed), so it imports nothing but the standard library.

kvstore ships on Linux x86_64 and aarch64 (Debian 12, Python 3.11, gcc: `make install`,
the Docker image). There a build that does not produce the extension fails the install:
the pure-Python fallback is several times slower on the hot path, and nobody should run
it without asking for it. Elsewhere, or with KVSTORE_NATIVE_OPTIONAL=1, the install goes
on without the extension and the fallback says so at run time (kvstore.native).
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Mapping

OPTIONAL_ENV = "KVSTORE_NATIVE_OPTIONAL"
SHIPPED = {("linux", "x86_64"), ("linux", "amd64"), ("linux", "aarch64"), ("linux", "arm64")}
RULE = (
    "the extension must build on Linux x86_64/aarch64; set KVSTORE_NATIVE_OPTIONAL=1 "
    "to install without it (pure-Python fallback, several times slower)"
)


def _os_name(sys_platform: str) -> str:
    return "linux" if sys_platform.startswith("linux") else sys_platform


def must_build(
    env: Mapping[str, str] = os.environ,
    sys_platform: str = sys.platform,
    machine: str | None = None,
) -> bool:
    """True where a missing extension is an error (see the module docstring)."""
    if env.get(OPTIONAL_ENV, "").strip() not in ("", "0"):
        return False
    machine = (platform.machine() if machine is None else machine).lower()
    return (_os_name(sys_platform), machine) in SHIPPED
