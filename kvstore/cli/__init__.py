"""kvctl: operator command-line tools for kvstore (status, flush, quotas, planning, trace
analysis)."""

import os
import sys

# Before anything imports grpc (it reads this once): gRPC's core logs a failed TLS
# handshake to stderr at INFO, a line of its own before kvctl's message says what to
# check. Unless the operator asks for its logs (GRPC_VERBOSITY=INFO), only its errors.
# Only when kvctl itself runs (its script, or `python -m kvstore.cli`, whose argv[0] is
# "-m" while the package loads), not in a process that imports it; and the processes
# kvctl starts (`cluster up`) do not inherit it (devprocs.spawn drops it, by QUIETED).
QUIETED = "KVSTORE_KVCTL_SET_GRPC_VERBOSITY"
if os.path.basename(sys.argv[0]) in ("kvctl", "-m") and "GRPC_VERBOSITY" not in os.environ:
    os.environ["GRPC_VERBOSITY"] = "ERROR"
    os.environ[QUIETED] = "1"
