"""Raw local-lane connections for the tests: what a client that does not use
kvstore.client could send (bad frames, descriptors, stalls)."""

from __future__ import annotations

import socket

from kvstore import lane


def read_frame(s: socket.socket) -> tuple[int, bytes]:
    """One response (or greeting) frame: (status, body)."""
    head = s.recv(lane.RESPONSE_HEADER.size, socket.MSG_WAITALL)
    if len(head) < lane.RESPONSE_HEADER.size:
        raise ConnectionResetError(f"the agent closed the lane ({len(head)} header bytes)")
    n, status = lane.RESPONSE_HEADER.unpack(head)
    body = s.recv(n, socket.MSG_WAITALL) if n else b""
    return status, body


def connect(path: str, timeout: float = 10.0) -> tuple[socket.socket, tuple[int, bytes]]:
    """A connected socket and the agent's greeting (status 0 and the lane id, or why not)."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    s.connect(path)
    return s, read_frame(s)


def raw_call(path: str, frame: bytes, fds: list[int] | None = None) -> tuple[int, bytes]:
    """Send one raw frame (with `fds` attached) and hang up; the agent's one response,
    after which the agent has closed its end."""
    s, (status, _) = connect(path)
    with s:
        assert status == lane.OK
        if fds:
            sent = socket.send_fds(s, [frame], fds)
            s.sendall(frame[sent:])
        else:
            s.sendall(frame)
        s.shutdown(socket.SHUT_WR)
        answer = read_frame(s)
        assert closed(s)  # nothing else, then the agent closes its end
        return answer


def closed(s: socket.socket) -> bool:
    """Whether the agent closed its end (a close with our bytes unread is a reset)."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
