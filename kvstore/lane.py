"""Wire format of the same-host local lane: Lookup, Get and Put over a Unix socket.

Why: a unary Python gRPC call costs 0.6-0.9 ms on a small host before any work is done,
which is more than a 2,000-block Lookup (~40 us in the store) or the control part of a
128 MiB shared-memory Get. A client whose shared-memory region the agent accepted is on
the same host, so the agent tells it a Unix socket path (RegisterShmResponse.local_socket)
and the hot calls go over that socket instead. The messages are the gRPC ones (the same
protobuf requests and responses) and the agent runs them through the same interceptors
(authentication, error mapping, metrics, tracing) and servicer; only the transport differs.

Frames, little-endian:

    request:  u32 body_len | u8 method | u16 meta_len | meta | message
    response: u32 body_len | u8 status | body   (status 0: message; else UTF-8 details)

`meta` is `key=value` lines (authorization on the first call, traceparent when a span is
active): the same metadata a gRPC call would carry. Status codes are grpc.StatusCode
numbers. One call at a time per connection.
"""

from __future__ import annotations

import struct
from typing import Final

REQUEST_HEADER: Final = struct.Struct("<IBH")
RESPONSE_HEADER: Final = struct.Struct("<IB")
MAX_FRAME_BYTES: Final = 64 << 20  # bodies are control messages; payloads go through shm

LOOKUP: Final = 1
GET: Final = 2
PUT: Final = 3
METHODS: Final = {LOOKUP: "Lookup", GET: "Get", PUT: "Put"}
SERVICE: Final = "/kvstore.v1.NodeAgent/"

OK: Final = 0


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
