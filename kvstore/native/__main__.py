"""`python -m kvstore.native`: print what hashing and checksums use. Exit status 1 when
the extension does not import where it must build (`make install` runs this after pip,
which catches a build that succeeded but left a module that cannot load)."""

from __future__ import annotations

import importlib
import sys

from kvstore.native import EXTENSION, RULE, active, must_build


def main() -> int:
    print(f"kvstore native acceleration: {active()}")
    try:  # whatever KVSTORE_NO_NATIVE says
        importlib.import_module(EXTENSION)
    except ImportError as exc:
        if must_build():
            print(f"error: {EXTENSION} does not import ({exc}); {RULE}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
