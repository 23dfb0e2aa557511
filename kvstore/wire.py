"""Conversions between the core's types and the gRPC messages (kvstore/v1), written once:
namespaces and policies both ways, packed block ids with their limits. The servicers, the
peer code and the client all go through here, so a field added to the proto has one place
to be mapped and every edge refuses a malformed id list with the same INVALID_ARGUMENT."""

from __future__ import annotations

from typing import cast

from kvstore.config import MESSAGE_PAYLOAD_BYTES
from kvstore.errors import InvalidArgument
from kvstore.events import EventKind, Tier
from kvstore.hashing import BLOCK_ID_BYTES, split_ids
from kvstore.namespace import Namespace
from kvstore.policy import NamespacePolicy
from kvstore.units import host_problem, split_port
from kvstore.v1 import agent_pb2, common_pb2

_NS_FIELDS = tuple(f.name for f in common_pb2.Namespace.DESCRIPTOR.fields)


def namespace_to_proto(spec: Namespace) -> common_pb2.Namespace:
    return common_pb2.Namespace(**spec.to_dict())


def namespace_from_proto(msg: common_pb2.Namespace) -> Namespace:
    """Validated like any Namespace: a missing field is InvalidArgument naming it."""
    return Namespace.from_dict({f: getattr(msg, f) for f in _NS_FIELDS})


def policy_to_proto(p: NamespacePolicy) -> common_pb2.NamespacePolicy:
    return common_pb2.NamespacePolicy(
        ttl_seconds=int(p.ttl_seconds),
        min_prefix_blocks=p.min_prefix_blocks,
        persist=p.persist,
        pin_budget_bytes=p.pin_budget_bytes,
    )


def check_id(value: bytes, what: str = "block id") -> bytes:
    if len(value) != BLOCK_ID_BYTES:
        raise InvalidArgument(f"{what} must be {BLOCK_ID_BYTES} bytes, got {len(value)}")
    return value


def blocks_per_message(block_bytes: int, most: int) -> int:
    """How many blocks of `block_bytes` one message carries: at most `most`, at most
    MESSAGE_PAYLOAD_BYTES of payload, at least one. A Put message (the client) and a Get
    response (the agent) carry no more, so an agent's max_message_bytes need not be more
    than a few MiB however a caller batches its blocks (kvstore/config.py)."""
    return max(1, min(most, MESSAGE_PAYLOAD_BYTES // max(1, block_bytes)))


MAX_REQUEST_ID = 256  # characters of a request_id (agents' Lookup / Get, the router's Route)


def check_request_id(rid: str) -> str:
    """A caller's request id, refused when longer than MAX_REQUEST_ID: agents and routers
    keep ids (the request tally, the router's in-flight table) until they expire."""
    if len(rid) > MAX_REQUEST_ID:
        raise InvalidArgument(
            f"request_id has {len(rid)} characters; the limit is {MAX_REQUEST_ID}"
        )
    return rid


def check_host_port(address: str, what: str) -> str:
    """`address` as host:port (a name, an IPv4 address or a [bracketed] IPv6 one, and a
    port in 1..65535), refused before any connection is tried: gRPC takes other targets
    too (unix:, dns:, ...) and wraps a port over 65535 round to another one."""
    parts = split_port(address)
    if len(address) > 261 or parts is None or not 0 < parts[1] < 65536:
        raise InvalidArgument(
            f"{what} must be host:port with a port in 1..65535, got {address[:80]!r}"
        )
    if problem := host_problem(parts[0]):
        raise InvalidArgument(f"{what}: {problem}")
    return address


def unpack_ids(packed: bytes, max_blocks: int, what: str = "block_ids") -> list[bytes]:
    """Packed ids off the wire (16 bytes each, prefix order), at most `max_blocks`."""
    if len(packed) % BLOCK_ID_BYTES:
        raise InvalidArgument(f"{what} is {len(packed)} bytes, not a multiple of {BLOCK_ID_BYTES}")
    n = len(packed) // BLOCK_ID_BYTES
    if n > max_blocks:
        raise InvalidArgument(f"request names {n} blocks; the limit is {max_blocks} per request")
    # The store and servicers take plain bytes ids; a BlockId is one (a NewType), but a
    # list of them is not a list[bytes] to mypy (lists are invariant).
    return cast("list[bytes]", split_ids(packed))


# kvstore.events' enums carry the proto's numbers (their docstrings say so), so the number
# is the wire value; the generated stubs type enum fields as the proto's own int class.
def tier_to_proto(tier: Tier) -> common_pb2.Tier:
    return cast("common_pb2.Tier", int(tier))


def kind_to_proto(kind: EventKind) -> agent_pb2.Event.Kind:
    return cast("agent_pb2.Event.Kind", int(kind))
