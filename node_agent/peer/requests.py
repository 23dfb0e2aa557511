"""What both sides of peer transfer check in a request: the namespace it names (opened
from its spec when this node never saw it; generation fencing; access), the block ids."""

from __future__ import annotations

from kvstore import errors
from kvstore.store import BlockStore, NsState
from kvstore.wire import namespace_from_proto, unpack_ids
from kvstore.auth import check_creates, check_namespace, is_reader


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
        generation fencing applies (store.namespace). Access is decided first, from the
        caller and the spec (known here, or sent: the id is the spec's hash, so a spec
        proves whose namespace it is): a refused call opens nothing, registers nothing in
        etcd and reads the same whether or not the namespace exists here."""
        if len(ref.namespace_id) != 16:
            raise errors.InvalidArgument("namespace_id must be 16 bytes")
        spec = None
        if spec_msg is not None:
            spec = namespace_from_proto(spec_msg)
            if spec.namespace_id != ref.namespace_id:
                raise errors.InvalidArgument("spec does not match namespace_id")
        known = self._store.spec_of(ref.namespace_id)
        check_namespace(tenant, known or spec, write, peer=True)
        if known is None and spec is not None:
            if is_reader(tenant, spec):  # etcd is read for readers only
                registered = self._control is not None and await self._control.registered(spec)
                check_creates(tenant, spec, registered)
            if self._control is not None:
                await self._control.open_namespace(spec)
            else:
                self._store.open_namespace(spec)
        return self._store.namespace(ref.namespace_id, ref.generation)

    def ids(self, packed: bytes) -> list[bytes]:
        return unpack_ids(packed, self._max_blocks)

    @staticmethod
    def parent(parent_id: bytes) -> bytes:
        if parent_id and len(parent_id) != 16:
            raise errors.InvalidArgument("parent_id must be empty or 16 bytes")
        return parent_id
