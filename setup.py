"""Build declaration for the native extension (metadata lives in pyproject.toml)."""
import platform
import sys

from setuptools import Extension, setup

_compile_args = ["-O3"]
if platform.machine().lower() in ("x86_64", "amd64") and sys.platform != "win32":
    _compile_args.append("-march=x86-64-v2")

setup(
    ext_modules=[
        Extension(
            "kvstore._native",
            ["kvstore/_native.c"],
            extra_compile_args=_compile_args,
            optional=True,  # pure-Python fallbacks exist in kvstore.hashing/checksum
        )
    ],
)
