"""Client end of the same-host local lane (frames in kvstore/lane.py).

Errors the agent answers come back as LaneError, a KVClientError (so a grpc.RpcError) with
the same code() and details() the gRPC call would have raised, so callers handle both
paths alike. A call past its deadline raises DeadlineExceeded and closes the connection
(the stream is out of step). A broken connection raises LaneBroken: the client then
registers with the agent again (it may have restarted) and retries.
"""

from __future__ import annotations

import socket
import threading
from collections import deque
import time
from dataclasses import dataclass

import grpc

from kvstore.telemetry import trace_metadata
from kvstore import lane
from kvstore.client.errors import DeadlineExceeded, KVClientError

_STATUS = {code.value[0]: code for code in grpc.StatusCode}


class LaneError(KVClientError):
    """An error status the agent answered over the lane."""


class LaneDeadline(LaneError, DeadlineExceeded):
    """DEADLINE_EXCEEDED answered by the agent: the connection is still in step."""

    def __init__(self, details: str) -> None:
        DeadlineExceeded.__init__(self, details)


class LaneBroken(ConnectionError):
    """The socket failed mid-call; the connection is closed and must not be reused."""


class AnswerGone(LaneBroken):
    """Another call read the answer a `start` was waiting for; the connection is fine."""


@dataclass(frozen=True, slots=True, eq=False)
class Sent:
    """A request sent on a lane connection, whose answer is still to be read."""

    deadline: float  # time.monotonic() by which the answer must have come


class LaneChannel:
    """One connection to an agent's local lane; calls are serialised by a lock."""

    def __init__(
        self,
        path: str,
        metadata: tuple = (),
        timeout_s: float = 10.0,
        lane_id: bytes | None = None,
    ) -> None:
        """`timeout_s`: the connect's bound and the default deadline of a call.
        `lane_id`: what the agent said its lane greets with (LocalLaneResponse); a socket
        that greets otherwise is not that agent's, and nothing is sent to it."""
        self.path = path
        self._md = tuple(metadata)
        self._timeout = timeout_s
        self._lock = threading.Lock()
        self._unread: deque[Sent] = deque()  # sent by start, answers not read yet
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(path)
            n, status = lane.RESPONSE_HEADER.unpack(self._recv(lane.RESPONSE_HEADER.size))
            greeting = bytes(self._recv(min(n, 1 << 16)))
        except OSError:
            self._sock.close()
            raise
        if status != lane.OK:  # refused: too many connections, or not allowed
            self._sock.close()
            raise LaneError(
                _STATUS.get(status, grpc.StatusCode.UNKNOWN), greeting.decode(errors="replace")
            )
        if lane_id is not None and greeting != lane_id:
            self._sock.close()
            raise LaneBroken(f"local lane {path}: the socket there is not this agent's")

    def close(self) -> None:
        self._sock.close()

    def call(self, method: int, request, response_type, timeout: float | None = None, fds=()):
        """Send `request` (a protobuf message), return a `response_type` message; wait at
        most `timeout` seconds (the channel's default when None) for the answer. `fds`:
        file descriptors to hand over with the frame (RegisterShm's staging memory)."""
        with self._lock:
            sent = self._send_request(method, request, timeout, fds)
            return self._read_answer(sent, response_type)

    def start(self, method: int, request, timeout: float | None = None) -> Sent:
        """The first half of `call`: send `request` now; `finish` reads its answer, by
        the same deadline. Until then the agent works on it while the caller does
        something else; several may be started (the agent answers a connection's
        requests in order). A call made meanwhile on this connection, or finishing a
        later one first, reads and drops the answer: `finish` then raises AnswerGone."""
        with self._lock:
            sent = self._send_request(method, request, timeout, (), drain=False)
            self._unread.append(sent)
            return sent

    def finish(self, sent: Sent, response_type):
        """The answer to `sent` (from `start`) as a `response_type` message."""
        with self._lock:
            if sent not in self._unread:
                raise AnswerGone(f"local lane {self.path}: another call read the answer")
            while self._unread[0] is not sent:  # answered before ours: read, dropped
                self._unread.popleft()
                self._guard(self._recv_answer, sent.deadline)
            self._unread.popleft()
            return self._read_answer(sent, response_type)

    def _send_request(self, method: int, request, timeout: float | None, fds, drain=True) -> Sent:
        """Send one request frame (under the lock); with `drain`, after reading the
        answers nobody finished: they come first."""
        meta = lane.encode_meta(trace_metadata(self._md))
        frame = lane.request_frame(method, meta, request.SerializeToString())
        wait = self._timeout if timeout is None else timeout
        if wait <= 0:
            raise DeadlineExceeded(f"local lane {self.path}: the deadline passed before the call")
        sent = Sent(time.monotonic() + wait)
        self._guard(lambda: self._send(frame, fds), sent.deadline)
        while drain and self._unread:  # answered before ours, within our deadline too
            self._unread.popleft()
            self._guard(self._recv_answer, sent.deadline)
        return sent

    def _read_answer(self, sent: Sent, response_type):
        status, body = self._guard(self._recv_answer, sent.deadline)
        if status == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]:  # the agent's own verdict
            raise LaneDeadline(body.decode(errors="replace"))
        if status != lane.OK:
            raise LaneError(
                _STATUS.get(status, grpc.StatusCode.UNKNOWN), body.decode(errors="replace")
            )
        return response_type.FromString(body)

    def _recv_answer(self) -> tuple[int, bytearray]:
        n, status = lane.RESPONSE_HEADER.unpack(self._recv(lane.RESPONSE_HEADER.size))
        return status, self._recv(n)

    def _guard(self, io, deadline: float):
        """`io()` on the socket by `deadline`; a timeout or a socket error leaves the
        stream out of step, so the connection is closed (never reused)."""
        wait = max(deadline - time.monotonic(), 0.001)
        try:
            self._sock.settimeout(wait)
            return io()
        except TimeoutError:  # the stream is out of step now: never reuse it
            self._sock.close()
            raise DeadlineExceeded(
                f"local lane {self.path}: no answer within {wait:.3g} s"
            ) from None
        except OSError as exc:
            self._sock.close()
            raise LaneBroken(f"local lane {self.path}: {exc}") from exc

    def _send(self, frame: bytes, fds) -> None:
        if not fds:
            self._sock.sendall(frame)
            return
        sent = socket.send_fds(self._sock, [frame], list(fds))  # fds ride on the first byte
        if sent < len(frame):  # never an empty send: one after an agent that refused the
            # frame from its header (and hung up) fails EPIPE, losing its answer
            self._sock.sendall(frame[sent:])

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
