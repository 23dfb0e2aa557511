"""Wire format of the same-host local lane: Lookup, Get, Put and RegisterShm over a Unix
socket.

Why: a unary Python gRPC call costs 0.6-0.9 ms on a small host before any work is done,
which is more than a 2,000-block Lookup (~40 us in the store) or the control part of a
128 MiB shared-memory Get. A client on the same host asks the agent for its socket
(the LocalLane RPC) and the hot calls go over that socket instead. The messages are the
gRPC ones (the same protobuf requests and responses) and the agent runs them through the
same interceptors (authentication, error mapping, metrics, tracing) and servicer; only the
transport differs.

The lane is also the only way to register shared memory: RegisterShm's frame carries the
file descriptor of the client's staging memory (SCM_RIGHTS ancillary data), so the agent
maps memory the caller holds, never a file named by whoever asks (anyone on the host can
name a file under /dev/shm).

Frames, little-endian:

    greeting: u32 body_len | u8 status | body  (agent -> client on connect; status 0:
              the agent's lane id, as LocalLaneResponse.lane_id says; else UTF-8 details)
    request:  u32 body_len | u8 method | u16 meta_len | meta | message
    response: u32 body_len | u8 status | body   (status 0: message; else UTF-8 details)

`meta` is `key=value` lines (authorization, traceparent when a span is active): the same
metadata a gRPC call would carry. The agent reads a request's header and meta, and
authenticates the caller, before it reads (buffers) any of the message: an
unauthenticated caller can make it hold at most MAX_META_BYTES. Status codes are
grpc.StatusCode numbers. One call at a time per connection.
"""

from __future__ import annotations

import struct
from typing import Final

REQUEST_HEADER: Final = struct.Struct("<IBH")
RESPONSE_HEADER: Final = struct.Struct("<IB")
# Bodies are control messages (payloads go through shared memory): a Put of 8,192 blocks
# (max_blocks_per_request) is ~350 KB, so 8 MiB leaves room and bounds what one
# authenticated connection can make the agent buffer.
MAX_FRAME_BYTES: Final = 8 << 20
MAX_META_BYTES: Final = 16 << 10  # a bearer token and a traceparent, with room to spare
LANE_ID_BYTES: Final = 16

LOOKUP: Final = 1
GET: Final = 2
PUT: Final = 3
REGISTER: Final = 4  # RegisterShm, with the memory's file descriptor attached
METHODS: Final = {LOOKUP: "Lookup", GET: "Get", PUT: "Put", REGISTER: "RegisterShm"}
SERVICE: Final = "/kvstore.v1.NodeAgent/"

OK: Final = 0


def header_problem(body_len: int, meta_len: int) -> str | None:
    """Why a request header must be refused before anything after it is read; None when
    it may be read on (the caller is authenticated from the meta before the message)."""
    if body_len > MAX_FRAME_BYTES:
        return f"local-lane frame of {body_len} bytes refused; the limit is {MAX_FRAME_BYTES}"
    if meta_len > body_len:
        return f"local-lane metadata of {meta_len} bytes is longer than the body ({body_len})"
    if meta_len > MAX_META_BYTES:
        return f"local-lane metadata of {meta_len} bytes refused; the limit is {MAX_META_BYTES}"
    return None


def encode_meta(pairs) -> bytes:
    """Metadata pairs -> b"k=v\\nk=v"; keys and values must not hold newlines."""
    out = []
    for k, v in pairs:
        if "\n" in k or "\n" in v or "=" in k:
            raise ValueError(f"metadata {k!r} cannot travel on the local lane")
        out.append(f"{k}={v}")
    return "\n".join(out).encode()


def decode_meta(raw: bytes) -> tuple[tuple[str, str], ...]:
    if not raw:
        return ()
    pairs = []
    for line in raw.decode().split("\n"):
        k, sep, v = line.partition("=")
        if not sep:
            raise ValueError(f"malformed metadata line {line[:40]!r}")
        pairs.append((k, v))
    return tuple(pairs)


def request_frame(method: int, meta: bytes, message: bytes) -> bytes:
    return REQUEST_HEADER.pack(len(meta) + len(message), method, len(meta)) + meta + message


def response_frame(status: int, body: bytes) -> bytes:
    return RESPONSE_HEADER.pack(len(body), status) + body
