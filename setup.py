"""Build declaration for the native extension kvstore._native (metadata lives in
pyproject.toml). Its sources are in kvstore/native/ (hashes, copy kernels, CPython glue).

Where the extension must build (kvstore/native/required.py: Linux x86_64/aarch64, unless
KVSTORE_NATIVE_OPTIONAL=1) a failed build fails the install with a message saying what to
do. Elsewhere it only warns, and kvstore falls back to pure Python, visibly: a log line at
import and the agent's Stats field native_accel."""

import importlib.util
import platform
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, ExecError, PlatformError

SRC = "kvstore/native"
SOURCES = [
    f"{SRC}/{name}.c"
    for name in (
        "module",
        "blake2b",
        "blake2b_avx2",
        "xxh64",
        "copy",
        "idtable",
        "idwalk",
        "batch",
        "paged",
    )
]
HEADERS = [
    f"{SRC}/{name}.h"
    for name in (
        "common",
        "blake2b",
        "blake2b_impl",
        "xxh64",
        "copy",
        "idtable",
        "idtable_impl",
        "batch",
        "paged",
    )
]


def _required_rule():
    """kvstore/native/required.py, loaded by path: kvstore is not importable yet."""
    path = Path(__file__).resolve().parent / SRC / "required.py"
    spec = importlib.util.spec_from_file_location("_kvstore_native_required", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_RULE = _required_rule()
REQUIRED = _RULE.must_build()


class BuildNative(build_ext):
    """build_ext that names the extension, the rule and the way out when it fails."""

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except (CCompilerError, ExecError, PlatformError) as exc:
            what = f"building {ext.name} from {SRC}/ failed: {exc}"
            if REQUIRED:
                raise SystemExit(
                    f"\nerror: {what}\n  {_RULE.RULE}.\n  The compiler output above says "
                    "why; the build needs gcc and the Python headers (Debian: apt-get "
                    "install build-essential python3-dev, or `make deps-system`)."
                ) from None
            print(
                f"\nWARNING: {what}\n  installing without it: kvstore hashing and "
                "checksums use the pure-Python fallback (several times slower).",
                file=sys.stderr,
            )


_compile_args = ["-O3"]
_link_args: list[str] = []
if sys.platform != "win32":
    _compile_args.append("-fvisibility=hidden")  # export PyInit__native only
    _compile_args.append("-pthread")  # batch.c splits a batch over threads
    _link_args.append("-pthread")
    if platform.machine().lower() in ("x86_64", "amd64"):
        _compile_args.append("-march=x86-64-v2")

setup(
    ext_modules=[
        Extension(
            "kvstore._native",
            SOURCES,
            depends=HEADERS,  # rebuild when a header changes; ship them in the sdist
            include_dirs=[SRC],
            extra_compile_args=_compile_args,
            extra_link_args=_link_args,
            optional=not REQUIRED,  # BuildNative has already warned
        )
    ],
    cmdclass={"build_ext": BuildNative},
)
