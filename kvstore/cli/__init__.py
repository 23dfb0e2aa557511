"""kvctl: operator command-line tools for kvstore (status, flush, quotas, planning, trace
analysis)."""

import os

# Before anything imports grpc (it reads this once): gRPC's core logs a failed TLS
# handshake to stderr at INFO, a line of its own before kvctl's message says what to
# check. Unless the operator asks for its logs (GRPC_VERBOSITY=INFO), only its errors.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
