"""The local lane's socket plumbing: the listening socket (created with its final mode, so
there is no moment at which anyone may connect), the peer's credentials, and reads that
keep the file descriptors a client passes along (SCM_RIGHTS), which asyncio's streams
drop."""

from __future__ import annotations

import array
import asyncio
import os
import shutil
import socket
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
MAX_FDS = 2  # descriptors accepted with one message; more are cut off by the kernel
# Descriptors a connection holds at once (for the frame being read): RegisterShm takes one.
# Past it, each one that arrives is closed at once: 1-byte messages carrying 2 each
# otherwise piled up, unauthenticated, until the agent ran out of descriptors.
MAX_HELD_FDS = 2
_ANC_BYTES = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)


@dataclass(frozen=True, slots=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


def peer_cred(sock: socket.socket) -> PeerCred:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return PeerCred(*_UCRED.unpack(raw))


def _groups_of(pid: int) -> set[int]:
    """Supplementary groups of a process (SO_PEERCRED carries only its primary group)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()


def peer_allowed(cred: PeerCred, group_gid: int | None) -> bool:
    """The agent's own user and root always; with a lane group, its members too."""
    if cred.uid in (0, os.getuid()):
        return True
    if group_gid is None:
        return False
    return cred.gid == group_gid or group_gid in _groups_of(cred.pid)


def bind_listener(path: str, mode: int, gid: int | None, backlog: int = 128) -> socket.socket:
    """A listening Unix socket at `path` with `mode` (and group `gid`) from the start:
    bound in a private directory, given its mode, then renamed into place."""
    scratch = tempfile.mkdtemp(prefix=".kvstore-lane-", dir=os.path.dirname(path))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        tmp = os.path.join(scratch, "s")
        sock.bind(tmp)
        if gid is not None:
            os.chown(tmp, -1, gid)
        os.chmod(tmp, mode)
        sock.listen(backlog)
        os.rename(tmp, path)
    except BaseException:
        sock.close()
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    sock.setblocking(False)
    return sock


class FrameReader:
    """Reads exactly n bytes at a time from a non-blocking socket, collecting any file
    descriptors that arrive with them (the caller takes or closes them)."""

    def __init__(self, sock: socket.socket, dropped: Callable[[int], None] | None = None) -> None:
        """`dropped(n)`: told of descriptors closed on arrival (past MAX_HELD_FDS)."""
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._dropped = dropped
        self.fds: list[int] = []
        self.truncated = False  # the sender attached more descriptors than this frame keeps

    async def read(self, n: int) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            try:
                k, anc, flags, _ = self._sock.recvmsg_into([view[got:]], _ANC_BYTES)
            except BlockingIOError:
                await self._readable()
                continue
            self._keep(anc, flags)
            if not k:
                raise asyncio.IncompleteReadError(bytes(buf[:got]), n)
            got += k
        return buf

    def _keep(self, anc: list, flags: int) -> None:
        """Keep what arrived, up to MAX_HELD_FDS; close the rest (and say so: truncated)."""
        if flags & socket.MSG_CTRUNC:
            self.truncated = True
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
                kept = max(0, min(len(fds), MAX_HELD_FDS - len(self.fds)))
                self.fds.extend(fds[:kept])
                for fd in fds[kept:]:
                    os.close(fd)
                if kept < len(fds):
                    self.truncated = True
                    if self._dropped is not None:
                        self._dropped(len(fds) - kept)

    async def _readable(self) -> None:
        fut: asyncio.Future[None] = self._loop.create_future()
        fd = self._sock.fileno()

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        self._loop.add_reader(fd, ready)
        try:
            await fut
        finally:
            self._loop.remove_reader(fd)

    def take_fds(self) -> list[int]:
        fds, self.fds, self.truncated = self.fds, [], False
        return fds

    def close_fds(self) -> None:
        for fd in self.take_fds():
            os.close(fd)
