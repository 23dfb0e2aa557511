"""kvstore core: namespaces, block hashing, payload format, tiers, eviction, accounting,
events and configuration. No network I/O here (the client subpackage is the exception)."""
