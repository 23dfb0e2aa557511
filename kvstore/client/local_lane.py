"""Client end of the same-host local lane (frames in kvstore/lane.py).

Errors the agent answers come back as LaneError, a grpc.RpcError with the same code() and
details() the gRPC call would have raised, so callers handle both paths alike. A broken
connection raises LaneBroken: the client then drops the lane and retries over gRPC.
"""
from __future__ import annotations

import socket
import threading

import grpc

from kvstore.telemetry import trace_metadata
from kvstore import lane

_STATUS = {code.value[0]: code for code in grpc.StatusCode}


class LaneError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class LaneBroken(ConnectionError):
    """The socket failed mid-call; the connection is closed and must not be reused."""


class LaneChannel:
    """One connection to an agent's local lane; calls are serialised by a lock."""

    def __init__(self, path: str, metadata: tuple = (), timeout_s: float = 120.0) -> None:
        self.path = path
        self._md = tuple(metadata)
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(path)
        except OSError:
            self._sock.close()
            raise

    def close(self) -> None:
        self._sock.close()

    def call(self, method: int, request, response_type):
        """Send `request` (a protobuf message), return a `response_type` message."""
        meta = lane.encode_meta(trace_metadata(self._md))
        frame = lane.request_frame(method, meta, request.SerializeToString())
        with self._lock:
            try:
                self._sock.sendall(frame)
                n, status = lane.RESPONSE_HEADER.unpack(
                    self._recv(lane.RESPONSE_HEADER.size))
                body = self._recv(n)
            except OSError as exc:  # timeouts too: the stream is out of step now
                self._sock.close()
                raise LaneBroken(f"local lane {self.path}: {exc}") from exc
        if status != lane.OK:
            raise LaneError(_STATUS.get(status, grpc.StatusCode.UNKNOWN),
                            body.decode(errors="replace"))
        return response_type.FromString(body)

    def _recv(self, n: int) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self._sock.recv_into(view[got:])
            if not k:
                raise ConnectionResetError("the agent closed the local lane")
            got += k
        return buf
