"""The connector's side of the agent: one KVClient per role, namespaces opened on demand,
and every failure turned into "nothing cached" (recompute), never an exception.

A client is made lazily and remade after a failure (agent restarted, flushed generation:
the handles are dropped and reopened), at most once per `retry_s`, so a dead agent costs
the engine one failed connect per few seconds, not one per request.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

from kvstore.client import KVClient, NamespaceHandle
from kvstore.integrations.vllm_config import ConnectorSettings, salt_secret, salted
from kvstore.namespace import Namespace

log = logging.getLogger("vllm.kvstore")  # under vLLM's logger: its handlers print it

__all__ = ["AgentLink"]


class AgentLink:
    def __init__(self, settings: ConnectorSettings, spec: Namespace, role: str,
                 retry_s: float = 2.0) -> None:
        self.settings = settings
        self.spec = spec
        self.role = role
        self.retry_s = retry_s
        self._client: KVClient | None = None
        self._handles: dict[str, NamespaceHandle] = {}
        self._down_until = 0.0
        self._lock = threading.Lock()  # one call at a time: the staging area is shared

    # ---------------------------------------------------------------- plumbing
    def _connect(self) -> KVClient | None:
        if self._client is not None:
            return self._client
        if time.monotonic() < self._down_until:
            return None
        try:
            self._client = KVClient(self.settings.agent, token=self.settings.token,
                                    tenant_secret=self.settings.tenant_secret,
                                    shm_bytes=self.settings.shm_bytes)
        except Exception as exc:  # noqa: BLE001 - any failure means "recompute"
            self._mark_down(f"cannot reach agent {self.settings.agent}: {_why(exc)}")
            return None
        return self._client

    def _mark_down(self, reason: str) -> None:
        log.warning("kvstore %s: %s; recomputing for %.0f s", self.role, reason, self.retry_s)
        self._down_until = time.monotonic() + self.retry_s
        self._handles.clear()
        if self._client is not None:
            try:
                self._client.close()
            except Exception:  # noqa: BLE001 - closing a broken client
                pass
            self._client = None

    def _handle(self, client: KVClient, salt: str | None) -> NamespaceHandle:
        key = salt or ""
        h = self._handles.get(key)
        if h is None:
            spec = salted(self.spec, salt)
            h = client.open_namespace(spec)
            if salt:  # its own chain root, keyed by tenant secret and salt
                h = replace(h, root=spec.root(h.generation,
                                              salt_secret(self.settings.tenant_secret, salt)))
            self._handles[key] = h
        return h

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    # ------------------------------------------------------------------ calls
    def block_ids(self, tokens: list[int], salt: str | None) -> list[bytes] | None:
        """The chain ids of the full blocks of `tokens`; None when the agent is out."""
        with self._lock:
            client = self._connect()
            if client is None:
                return None
            try:
                return client.block_ids(self._handle(client, salt), tokens)
            except Exception as exc:  # noqa: BLE001
                self._mark_down(f"open namespace: {_why(exc)}")
                return None

    def matched(self, ids: list[bytes], salt: str | None) -> int:
        """How many leading blocks of `ids` the agent holds (0 on any failure)."""
        if not ids:
            return 0
        with self._lock:
            client = self._connect()
            if client is None:
                return 0
            try:
                return int(client.lookup(self._handle(client, salt), ids).matched)
            except Exception as exc:  # noqa: BLE001
                self._mark_down(f"lookup: {_why(exc)}")
                return 0

    def load(self, ids: list[bytes], parent: bytes | None, salt: str | None, sink) -> int:
        """Get blocks `ids` (children of `parent`, the root when None) and hand each run to
        `sink(first, blocks)`, blocks a (n, *block shape) tensor valid during the call.
        Returns how many leading blocks were loaded: fewer than asked means the rest must be
        recomputed (missing, failed verification, agent gone)."""
        with self._lock:
            client = self._connect()
            if client is None:
                return 0
            done = 0
            try:
                ns = self._handle(client, salt)
                cap = max(1, client.staging_capacity(ns))
                while done < len(ids):
                    chunk = ids[done: done + cap]
                    par = parent if done == 0 else ids[done - 1]
                    views = client.get_views(ns, chunk, par if par is not None else ns.root)
                    if views:
                        sink(done, torch_stack(views))
                    done += len(views)
                    if len(views) < len(chunk):
                        break
            except Exception as exc:  # noqa: BLE001
                self._mark_down(f"get: {_why(exc)}")
            return done

    def save(self, ids: list[bytes], parent: bytes | None, salt: str | None,
             blocks) -> int:
        """Put blocks (a (n, *block shape) tensor); returns how many were newly stored."""
        with self._lock:
            client = self._connect()
            if client is None:
                return 0
            try:
                ns = self._handle(client, salt)
                r = client.put(ns, ids, list(blocks.unbind(0)),
                               parent if parent is not None else ns.root)
                return int(r.stored)
            except Exception as exc:  # noqa: BLE001
                self._mark_down(f"put: {_why(exc)}")
                return 0


def torch_stack(views):
    import torch
    return torch.stack(views)


def _why(exc: Exception) -> str:
    details = getattr(exc, "details", None)
    if callable(details):
        try:
            return f"{exc.code().name}: {details()}"  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001
            pass
    return f"{type(exc).__name__}: {exc}"
