"""Bearer tokens for the agent's edges (node_agent/interceptors.EdgeInterceptor and the UCX
peer path, node_agent/peer/ucx/serve.py). The rule lives in kvstore/auth.py, below both the
agents and the routers, so that the router authenticates by the very same one."""

from __future__ import annotations

from kvstore.auth import TokenTable

__all__ = ["TokenTable"]
