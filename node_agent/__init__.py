"""Node agent: one process per GPU serving KV blocks over gRPC."""
