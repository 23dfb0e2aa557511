"""Raw local-lane connections for the tests: what a client that does not use
kvstore.client could send (bad frames, descriptors, stalls)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket

from kvstore import lane
from kvstore.v1 import agent_pb2


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


@contextlib.contextmanager
def lane_region(stub, size: int = 1 << 20, metadata=()):
    """A shared-memory region created and registered the way a client does it (a sealed
    memfd, every page allocated, handed over the agent's local lane); yields (lane path,
    region id). The region
    lives while the block runs (it dies with its lane connection)."""
    where = stub.LocalLane(agent_pb2.LocalLaneRequest(), metadata=metadata)
    fd = os.memfd_create("test-region", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        s, (status, body) = connect(where.socket)
        with s:
            assert status == lane.OK and body == where.lane_id, body
            req = agent_pb2.RegisterShmRequest(size=size).SerializeToString()
            frame = lane.request_frame(lane.REGISTER, lane.encode_meta(metadata), req)
            socket.send_fds(s, [frame], [fd])
            status, body = read_frame(s)
            assert status == lane.OK, body
            yield where.socket, agent_pb2.RegisterShmResponse.FromString(body).region_id
    finally:
        os.close(fd)
