"""The UCX listener answers only on the agent's configured address.

ucxx 0.52 cannot bind its listener to an address: its Python API
(`create_listener(callback, port=...)`, `UCXListener.create(worker, port, ...)`) takes a
port only, and its Cython declaration of the C++ `ListenerBuilder` leaves out the
`host()` setter libucxx has, so the listener always binds the wildcard address (0.0.0.0).
UCX has no setting for a listener's address either (`UCX_NET_DEVICES=lo` changes the
transports, not the sockaddr listener: still 0.0.0.0). So every connection the listener
accepts is checked for the local address it arrived on (UCX's C API `ucp_ep_query`,
`UCP_EP_ATTR_FIELD_LOCAL_SOCKADDR`, through ctypes) before one byte of the peer protocol,
and aborted unless that is the agent's configured listen host: an agent told to listen on
127.0.0.1 serves no UCX peer that dialled another interface of the host. When the query
fails the connection is refused too (fail closed). A wildcard listen host (0.0.0.0, ::)
accepts every interface, as the gRPC port does.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("kvstore.agent.peer")

_FIELD_LOCAL_SOCKADDR = 1 << 1  # UCP_EP_ATTR_FIELD_LOCAL_SOCKADDR (ucp.h, UCX >= 1.14)
_SOCKADDR_STORAGE = 128


class _EpAttr(ctypes.Structure):
    """ucp_ep_attr_t (ucp/api/ucp.h): only the fields up to local_sockaddr are read, the
    rest is room UCX may write into."""

    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("name", ctypes.c_char * 32),  # UCP_ENTITY_NAME_MAX
        ("local_sockaddr", ctypes.c_ubyte * _SOCKADDR_STORAGE),
        ("remote_sockaddr", ctypes.c_ubyte * _SOCKADDR_STORAGE),
        ("rest", ctypes.c_ubyte * 256),
    ]


def _ucp_ep_query() -> Callable[[int, Any], int]:
    # libucp is loaded by ucxx already: dlopen by its soname finds that copy.
    lib = ctypes.CDLL("libucp.so.0")
    fn = lib.ucp_ep_query
    fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(_EpAttr)]
    fn.restype = ctypes.c_int
    return fn


def local_address(ucp_ep: int) -> str:
    """The local IP address of a UCX endpoint's connection ('' when UCX cannot tell)."""
    attr = _EpAttr(field_mask=_FIELD_LOCAL_SOCKADDR)
    if _ucp_ep_query()(ucp_ep, ctypes.byref(attr)) != 0:
        return ""
    raw = bytes(attr.local_sockaddr)
    family = int.from_bytes(raw[:2], "little")
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, raw[4:8])
    if family == socket.AF_INET6:
        return socket.inet_ntop(socket.AF_INET6, raw[8:24])
    return ""


def _ips(host: str) -> frozenset[str]:
    """The addresses `host` (an IP or a name) stands for; empty: any (a wildcard)."""
    host = host.strip("[]")
    if host in ("", "0.0.0.0", "::", "*"):
        return frozenset()
    try:
        return frozenset({str(ipaddress.ip_address(host))})
    except ValueError:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        return frozenset(str(ipaddress.ip_address(i[4][0])) for i in infos)


def _normal(ip: str) -> str:
    addr = ipaddress.ip_address(ip)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)  # ::ffff:127.0.0.1 is 127.0.0.1
    return str(addr)


def net_devices(setting: str, bind_host: str) -> str:
    """UCX_NET_DEVICES for an agent listening on `bind_host` with peer.ucx_net_devices
    `setting` ("": UCX's default, every device). "auto" keeps an agent whose listen host
    stands only for loopback addresses to the loopback device: UCX's TCP transport listens
    on every device it uses, unauthenticated (docs/tls.md), and such an agent's peers are
    all on this host. A host that does not resolve: every device (UCX's default)."""
    if setting == "all":
        return ""
    if setting != "auto":
        return setting
    try:
        ips = _ips(bind_host)
    except OSError:
        return ""
    loopback = ips and all(ipaddress.ip_address(_normal(ip)).is_loopback for ip in ips)
    return "lo" if loopback else ""


class InterfaceGuard:
    """Wraps the listener's callback: connections that did not arrive on `host` are
    aborted before the handler sees them, and `refused()` is called."""

    def __init__(self, host: str, refused: Callable[[], None]) -> None:
        self.allowed = _ips(host)
        self.host = host
        self._refused = refused

    def admits(self, ucp_ep: int) -> bool:
        if not self.allowed:
            return True
        try:
            ip = local_address(ucp_ep)
        except (OSError, AttributeError) as exc:  # no libucp symbol: cannot tell
            log.warning("UCX connection refused: its local address is unknown (%s)", exc)
            return False
        return bool(ip) and _normal(ip) in self.allowed

    def wrap(self, handle: Callable[[Any], Awaitable[None]]) -> Callable[[Any], Awaitable[None]]:
        if not self.allowed:
            return handle

        async def guarded(ep: Any) -> None:
            if not self.admits(ep.ucp_endpoint):
                self._refused()
                log.warning(
                    "UCX connection on another interface than the configured %s refused",
                    self.host,
                )
                ep.abort()
                return
            await handle(ep)

        return guarded
