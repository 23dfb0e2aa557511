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
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from kvstore.client import KVClient, NamespaceHandle, PendingGet
from kvstore.integrations.vllm_config import ConnectorSettings, salt_secret, salted
from kvstore.namespace import Namespace

log = logging.getLogger("vllm.kvstore")  # under vLLM's logger: its handlers print it

__all__ = ["AgentLink", "Begun", "StagedGet"]

_NOTHING = torch.empty(0)  # what a failed Get served


@dataclass(frozen=True, slots=True)
class Begun:
    """Gets `AgentLink.begin` sent on `client`, in order, for `AgentLink.stage` to read."""

    client: KVClient | None
    sent: list[PendingGet]


@dataclass(frozen=True, slots=True)
class StagedGet:
    """One Get for `AgentLink.stage`: blocks `ids`, children of `parent` (None: the
    chain root), in the namespace of `salt`, counted for engine request `request_id`."""

    ids: list[bytes]
    parent: bytes | None
    salt: str | None
    request_id: str = ""


class AgentLink:
    def __init__(
        self, settings: ConnectorSettings, spec: Namespace, role: str, retry_s: float = 2.0
    ) -> None:
        self.settings = settings
        self.spec = spec
        self.role = role
        self.retry_s = retry_s
        self._client: KVClient | None = None
        self._handles: dict[str, NamespaceHandle] = {}
        self._down_until = 0.0
        self._lock = threading.Lock()  # one call at a time: the staging area is shared
        self._device: torch.device | None = None  # load into device staging on this GPU
        self._device_why = ""  # why device staging was refused, logged once

    # ---------------------------------------------------------------- plumbing
    def _connect(self) -> KVClient | None:
        if self._client is not None:
            return self._client
        if time.monotonic() < self._down_until:
            return None
        try:
            self._client = KVClient(
                self.settings.agent,
                token=self.settings.token,
                tenant_secret=self.settings.tenant_secret,
                shm_bytes=self.settings.shm_bytes,
                local_lane=self.settings.local_lane,
                timeout=self.settings.timeout_s,
                tls=self.settings.tls,
            )
        except Exception as exc:  # noqa: BLE001 - any failure means "recompute"
            self._mark_down(f"cannot reach agent {self.settings.agent}: {_why(exc)}")
            return None
        if self._device is not None:
            self._attach_device(self._client, self._device)
        return self._client

    def use_device(self, device: torch.device) -> None:
        """Load into staging on GPU `device` when the agent's pool is on that GPU too:
        blocks then go pool -> device staging -> the engine's cache without host memory."""
        self._device = device

    def _attach_device(self, client: KVClient, device: torch.device) -> None:
        try:
            why = client.attach_device_staging(device, self.settings.shm_bytes)
        except Exception as exc:  # noqa: BLE001 - host staging still serves
            why = _why(exc)
        if why and why != self._device_why:
            log.info("kvstore %s: loading through host staging: %s", self.role, why)
        elif not why:
            log.info("kvstore %s: loading through device staging on %s", self.role, device)
        self._device_why = why

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
                h = replace(
                    h, root=spec.root(h.generation, salt_secret(self.settings.tenant_secret, salt))
                )
            self._handles[key] = h
        return h

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    # ------------------------------------------------------------------ calls
    def _call(self, what: str, fn, default):
        """`fn(client)` under the lock; `default` when the agent is out or the call fails.
        A FAILED_PRECONDITION (e.g. the namespace was flushed: our generation is stale) is
        retried once at once on reopened namespaces."""
        with self._lock:
            for attempt in (0, 1):
                client = self._connect()
                if client is None:
                    return default
                try:
                    return fn(client)
                except Exception as exc:  # noqa: BLE001 - any failure means "recompute"
                    if attempt == 0 and _code(exc) == "FAILED_PRECONDITION":
                        log.info(
                            "kvstore %s: %s: %s; reopening the namespace",
                            self.role,
                            what,
                            _why(exc),
                        )
                        self._handles.clear()
                        continue
                    self._mark_down(f"{what}: {_why(exc)}")
                    return default
            return default

    def prefix(
        self,
        tokens: list[int],
        usable: int,
        salt: str | None,
        request_id: str = "",
        engine_held: int = 0,
    ) -> tuple[list[bytes], int]:
        """The chain ids of the full blocks of `tokens` and how many of the first `usable`
        the agent holds; ([], 0) when the agent is out. One call, so ids and answer come
        from the same generation (a flush in between reopens and recomputes both).
        `request_id`: the agent counts the engine request once, however often asked;
        `engine_held`: leading blocks the engine's own cache has, not counted as ours."""

        def run(client: KVClient) -> tuple[list[bytes], int]:
            ns = self._handle(client, salt)
            ids = client.block_ids(ns, tokens)
            head = ids[:usable]
            if not head:
                return ids, 0
            held = min(engine_held, len(head))
            r = client.lookup(ns, head, request_id=request_id, caller_held=held)
            return ids, int(r.matched)

        return self._call("lookup", run, ([], 0))

    def load(
        self,
        ids: list[bytes],
        parent: bytes | None,
        salt: str | None,
        sink: Callable[[int, torch.Tensor], None],
        request_id: str = "",
    ) -> int:
        """Get blocks `ids` (children of `parent`, the root when None) and hand each run to
        `sink(first, blocks)`, blocks a (n, *block shape) tensor valid during the call.
        Returns how many leading blocks were loaded: fewer than asked means the rest must be
        recomputed (missing, failed verification, agent gone, kill switch)."""
        progress = [0]

        def run(client: KVClient) -> int:
            ns = self._handle(client, salt)
            if not client.uses_shm:  # no shared memory (refused, or another host): gRPC
                blocks = client.get(ns, ids, parent, request_id=request_id)
                if blocks:
                    sink(0, torch.stack(blocks))
                progress[0] = len(blocks)
                return len(blocks)
            on_device = client.uses_device_staging
            get = client.get_device_staged_tensor if on_device else client.get_staged_tensor
            cap = client.device_staging_capacity(ns) if on_device else client.staging_capacity(ns)
            cap = max(1, cap)
            done = progress[0] = 0
            while done < len(ids):
                chunk = ids[done : done + cap]
                par = parent if done == 0 else ids[done - 1]
                # One tensor over the staging area: the sink copies it out in one go.
                got = get(ns, chunk, par, request_id=request_id)
                if len(got):
                    sink(done, got)
                done = progress[0] = done + len(got)
                if len(got) < len(chunk):
                    break
            return done

        got = self._call("get", run, None)
        return progress[0] if got is None else got

    def begin(self, gets: list[StagedGet]) -> Begun:
        """Send the Gets `stage(gets, begun)` reads, now (the agent copies and verifies
        the blocks meanwhile): as many as the staging area holds together. Nothing is
        sent when the agent is out; `stage` then makes the Gets itself."""

        def run(client: KVClient) -> Begun:
            sent: list[PendingGet] = []
            slot = 0
            if client.uses_device_staging:  # loads go device to device, through `load`
                return Begun(client, sent)
            for g in gets:
                ns = self._handle(client, g.salt)
                if slot + len(g.ids) > client.staging_capacity(ns):
                    break
                sent.append(
                    client.begin_get_staged(
                        ns, g.ids, g.parent, request_id=g.request_id, first_slot=slot
                    )
                )
                slot += len(g.ids)
            return Begun(client, sent)

        return self._call("get", run, Begun(None, []))

    def stage(self, gets: list[StagedGet], begun: Begun | None = None) -> list[torch.Tensor]:
        """Get each of `gets` into its own slots of the staging area, in order, while they
        fit in it together (the answers of those `begun` sent, else Gets made now): the
        leading blocks served of each (an empty tensor where the agent was out or the Get
        failed: recompute), valid until a later call on this link. Stops before the first
        that does not fit: those are for `load`."""
        out: list[torch.Tensor] = []
        slot = 0
        for i, g in enumerate(gets):
            pending = None
            if begun is not None and i < len(begun.sent):
                pending = begun.sent[i]

            def run(client: KVClient, g=g, first=slot) -> torch.Tensor | None:
                nonlocal pending
                p, pending = pending, None  # its answer once; a retry Gets again
                if p is not None and begun is not None and begun.client is client:
                    return client.finish_get_staged(p)
                if client.uses_device_staging:  # `load` serves them from device staging
                    return None
                ns = self._handle(client, g.salt)
                if first + len(g.ids) > client.staging_capacity(ns):
                    return None
                return client.get_staged_tensor(
                    ns, g.ids, g.parent, request_id=g.request_id, first_slot=first
                )

            got = self._call("get", run, _NOTHING)
            if got is None:
                break
            out.append(got)
            slot += len(g.ids)
        return out

    def warm(self) -> None:
        """Connect and open the unsalted namespace now (engine start-up): a client's first
        connect (shared memory mapped and registered, the lane) costs ~150 ms here, which
        would otherwise land on the first request's time to first token."""
        self.namespace(None)

    def namespace(self, salt: str | None) -> NamespaceHandle | None:
        """The open namespace of `salt` (None when the agent is out)."""
        return self._call("open", lambda client: self._handle(client, salt), None)

    def pull(
        self,
        ids: list[bytes],
        salt: str | None,
        peer: str,
        peer_transfer: str = "",
        timeout_s: float = 10.0,
    ) -> int:
        """Have the agent pull the leading blocks of `ids` it lacks from agent `peer`
        (gRPC host:port; `peer_transfer` its UCX listener, tried first when given).
        Returns how many leading blocks of `ids` the agent then holds (0 when out)."""

        def run(client: KVClient) -> int:
            ns = self._handle(client, salt)
            r = client.prefetch(ns, ids, peer, peer_transfer, timeout_ms=int(timeout_s * 1000))
            if r.stopped:
                log.info("kvstore %s: pull from %s stopped: %s", self.role, peer, r.stopped)
            return int(r.present)

        return self._call("pull", run, 0)

    def save(
        self, ids: list[bytes], parent: bytes | None, salt: str | None, blocks: torch.Tensor
    ) -> int:
        """Put blocks (a (n, *block shape) tensor); returns how many were newly stored."""

        def run(client: KVClient) -> int:
            ns = self._handle(client, salt)
            r = client.put(ns, ids, list(blocks.unbind(0)), ns.root if parent is None else parent)
            if r.not_stored:
                log.debug("kvstore %s: blocks not saved: %s", self.role, r.not_stored)
            return int(r.stored)

        return self._call("put", run, 0)


def _code(exc: Exception) -> str:
    code = getattr(exc, "code", None)
    if callable(code):
        try:
            return code().name
        except Exception:  # noqa: BLE001
            return ""
    return ""


def _why(exc: Exception) -> str:
    details = getattr(exc, "details", None)
    if callable(details):
        try:
            return f"{exc.code().name}: {details()}"  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001
            pass
    return f"{type(exc).__name__}: {exc}"
