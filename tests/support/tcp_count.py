"""A TCP relay that counts the bytes it carries each way, for checking which traffic a
path puts on a socket (tests/integration/test_tls_data_path.py): it relays TLS untouched,
so the client's handshake is with the server behind it. `pause()` holds everything it
would relay (both ways, connections stay open) until `resume()`: a network partition
between a member and etcd (tests/integration/test_lease_fence.py)."""

from __future__ import annotations

import socket
import threading


class CountingRelay:
    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._bytes = 0
        self._socks: list[socket.socket] = []
        self._flowing = threading.Event()
        self._flowing.set()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def bytes(self) -> int:
        """Bytes relayed so far, both directions together."""
        with self._lock:
            return self._bytes

    def pause(self) -> None:
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            server = socket.create_connection(self._target)
            self._socks += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                with self._lock:
                    self._bytes += len(data)
                self._flowing.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._listener.close()
        for s in self._socks:
            s.close()
