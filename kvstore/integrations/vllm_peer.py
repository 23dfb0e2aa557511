"""Peer pulls for the vLLM connector's scheduler: when the node's agent lacks a request's
prefix, the agent pulls it from the peer agent that holds it (Peer.Prefetch, UCX or gRPC),
and the request waits for the pull, not the engine.

Where the peer comes from, first found wins:
- the request's `kv_transfer_params` (what a gateway that routed it passes):
  `{"kvstore": {"peer": "<agent host:port>", "peer_transfer": "<its UCX address>"}}`
  (`peer_transfer` optional: gRPC is used without it);
- the router named by the connector's `router` setting: a dry-run Route of the prompt; the
  pull happens only when the router priced fetching from a peer as cheaper than
  recomputing for this node (its candidate has peer blocks).

A pull runs on a background thread with its own agent client; while it runs the scheduler
is told "not known yet" (`get_num_new_matched_tokens` returns None) and asks again next
step; once it ended the agent's own answer counts, so only blocks that arrived verified are
reported. Each request is pulled for at most once; any failure is a shorter prefix.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc

from kvstore.config import TLSConfig
from kvstore.integrations.vllm_agent import AgentLink
from kvstore.v1 import router_pb2, router_pb2_grpc
from kvstore.hashing import pack_ids
from kvstore.tls import channel
from kvstore.wire import namespace_to_proto

log = logging.getLogger("vllm.kvstore")

__all__ = ["PeerHint", "PeerPuller", "RouterLink", "hint_from_params"]

PARAMS_KEY = "kvstore"


@dataclass(frozen=True, slots=True)
class PeerHint:
    address: str  # the peer agent's gRPC host:port
    transfer: str = ""  # its UCX listener ("" : gRPC)


def hint_from_params(params: dict[str, Any] | None) -> PeerHint | None:
    """The peer named in a request's kv_transfer_params; None when none (a malformed one
    is logged and ignored: the request recomputes, it never fails)."""
    entry = (params or {}).get(PARAMS_KEY)
    if entry is None:
        return None
    peer = entry.get("peer") if isinstance(entry, dict) else None
    transfer = entry.get("peer_transfer", "") if isinstance(entry, dict) else ""
    if not isinstance(peer, str) or ":" not in peer or not isinstance(transfer, str):
        log.warning(
            "kvstore: kv_transfer_params[%r] must be {'peer': 'host:port', "
            "'peer_transfer': str (optional)}; ignored",
            PARAMS_KEY,
        )
        return None
    return PeerHint(peer, transfer)


class RouterLink:
    """Asks the router which peer to pull a prompt's blocks from, for this node."""

    def __init__(
        self,
        address: str,
        token: str | None,
        agent: str,
        timeout_s: float,
        tls: TLSConfig | None = None,
    ) -> None:
        self.agent = agent
        self.timeout_s = timeout_s
        self._md = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel = channel(address, tls)  # mTLS when the connector has TLS files
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    def peer_for(self, link: AgentLink, ids: list[bytes], salt: str | None) -> PeerHint | None:
        ns = link.namespace(salt)
        if ns is None or not ids:
            return None
        req = router_pb2.RouteRequest(
            namespace_id=ns.namespace_id,
            generation=ns.generation,
            block_ids=pack_ids(ids),
            dry_run=True,
            spec=namespace_to_proto(ns.spec),
        )
        try:
            resp = self._stub.Route(req, timeout=self.timeout_s, metadata=self._md)
        except grpc.RpcError as exc:
            log.warning("kvstore: router Route failed (%s); no peer pull", exc.code().name)
            return None
        by_node = {c.node_id: c for c in resp.candidates}
        mine = next((c for c in resp.candidates if c.address == self.agent), None)
        if mine is None or not mine.peer_blocks or mine.peer_node_id not in by_node:
            return None  # the router does not price a pull to this node as paying
        if resp.peer_hint == mine.peer_node_id and resp.peer_address:
            return PeerHint(resp.peer_address, resp.peer_transfer_address)
        return PeerHint(by_node[mine.peer_node_id].address)

    def close(self) -> None:
        self._channel.close()


class PeerPuller:
    """Background pulls, at most one per request, one at a time."""

    def __init__(self, link: AgentLink, router: RouterLink | None, timeout_s: float) -> None:
        self.link = link
        self.router = router
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-pull")
        self._pending: dict[str, Future[int]] = {}
        self._done: set[str] = set()

    def waiting(self, req_id: str) -> bool:
        """True while a pull for `req_id` runs (the scheduler should ask again later)."""
        fut = self._pending.get(req_id)
        if fut is None:
            return False
        if not fut.done():
            return True
        del self._pending[req_id]
        return False

    def start(self, req_id: str, ids: list[bytes], salt: str | None, hint: PeerHint | None) -> bool:
        """Start pulling `ids` for `req_id` unless it was tried already or there is no
        way to find a peer; True when a pull started."""
        if req_id in self._done or (hint is None and self.router is None):
            return False
        self._done.add(req_id)
        self._pending[req_id] = self._pool.submit(self._pull, req_id, ids, salt, hint)
        return True

    def _pull(self, req_id: str, ids: list[bytes], salt: str | None, hint: PeerHint | None) -> int:
        if hint is None and self.router is not None:
            hint = self.router.peer_for(self.link, ids, salt)
        if hint is None:
            return 0
        present = self.link.pull(ids, salt, hint.address, hint.transfer, self.timeout_s)
        log.info(
            "kvstore: request %s: %d of %d blocks held after a pull from %s",
            req_id,
            present,
            len(ids),
            hint.address,
        )
        return present

    def forget(self, req_id: str) -> None:
        self._pending.pop(req_id, None)
        self._done.discard(req_id)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.router is not None:
            self.router.close()
