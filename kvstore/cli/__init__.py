"""kvctl: operator command-line tools for kvstore (status, flush, quotas, planning, trace
analysis)."""
