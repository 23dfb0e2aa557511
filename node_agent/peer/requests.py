"""What both sides of peer transfer check in a request: the namespace it names (opened
from its spec when this node never saw it; generation fencing; access), the block ids."""

from __future__ import annotations

from kvstore import errors
from kvstore.hashing import BlockId
from kvstore.store import BlockStore, NsState
from kvstore.wire import namespace_from_proto, unpack_ids
from kvstore.auth import CLUSTER_TENANT


class PeerRequests:
    """Validation of FetchRequests (serving side) and PrefetchRequests (fetching side)."""

    def __init__(self, store: BlockStore, max_blocks_per_request: int) -> None:
        self._store = store
        self._max_blocks = max_blocks_per_request
        self._control = None  # node_agent/control.AgentControl when etcd is configured

    def use_control(self, control) -> None:
        """Open unseen namespaces through etcd's generations from now on (agent start)."""
        self._control = control

    async def namespace(self, ref, spec_msg, tenant: str | None, write: bool) -> NsState:
        """The namespace a request names, opened from its spec if this node never saw it;
        generation fencing applies (store.namespace)."""
        if len(ref.namespace_id) != 16:
            raise errors.InvalidArgument("namespace_id must be 16 bytes")
        try:
            st = self._store.namespace(ref.namespace_id, ref.generation)
        except errors.NotFound:
            if spec_msg is None:
                raise
            spec = namespace_from_proto(spec_msg)
            if spec.namespace_id != ref.namespace_id:
                raise errors.InvalidArgument("spec does not match namespace_id") from None
            if self._control is not None:
                await self._control.open_namespace(spec)
            else:
                self._store.open_namespace(spec)
            st = self._store.namespace(ref.namespace_id, ref.generation)
        check_peer_access(tenant, st, write)
        return st

    def ids(self, packed: bytes) -> list[BlockId]:
        return unpack_ids(packed, self._max_blocks)

    @staticmethod
    def parent(parent_id: bytes) -> bytes:
        if parent_id and len(parent_id) != 16:
            raise errors.InvalidArgument("parent_id must be empty or 16 bytes")
        return parent_id


def check_peer_access(tenant: str | None, st: NsState, write: bool) -> None:
    """Owners and cluster components (routers, peers) may move a namespace's blocks;
    other tenants may only read public namespaces."""
    if tenant is None or tenant == CLUSTER_TENANT or tenant == st.tenant:
        return
    if st.spec.public and not write:
        return
    raise errors.PermissionDenied(
        f"tenant {tenant!r} may not {'write' if write else 'read'} "
        f"namespaces of tenant {st.tenant!r}"
    )
