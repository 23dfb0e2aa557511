"""Fault injection: a gRPC proxy in front of a real agent that forwards every call as raw
bytes and, while `fail` names a method, answers that method UNAVAILABLE instead; while
`hold` names a method, its calls wait (an agent slow to answer them) until `release()`.

    proxy = AgentProxy(agent.address)      # clients use proxy.address
    proxy.fail = {"Get"}                   # Lookups still answer; Gets fail
    proxy.hold = {"Put"}                   # Puts wait; proxy.held: how many wait now
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc

# Methods of kvstore.v1.NodeAgent whose request or response is a stream.
_SERVER_STREAM = {"Get", "Subscribe"}
_CLIENT_STREAM = {"Put"}


class AgentProxy(grpc.GenericRpcHandler):
    def __init__(self, target: str) -> None:
        self.fail: set[str] = set()
        self.hold: set[str] = set()
        self.held = 0  # calls waiting in `hold` now
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()
        self._released = threading.Event()
        self._channel = grpc.insecure_channel(
            target,
            options=[
                ("grpc.max_send_message_length", 64 << 20),
                ("grpc.max_receive_message_length", 64 << 20),
            ],
        )
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=8),
            options=[
                ("grpc.max_send_message_length", 64 << 20),
                ("grpc.max_receive_message_length", 64 << 20),
            ],
        )
        self._server.add_generic_rpc_handlers((self,))
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        self._server.start()

    def release(self) -> None:
        """Let the held calls through; later ones are not held until `hold` is set again."""
        self.hold = set()
        released, self._released = self._released, threading.Event()
        released.set()

    def close(self) -> None:
        self._released.set()
        self._server.stop(grace=None)
        self._channel.close()

    def _check(self, method: str, context) -> None:
        name = method.rsplit("/", 1)[-1]
        self.calls[name] = self.calls.get(name, 0) + 1
        if name in self.fail:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"injected fault: {name} fails")
        if name in self.hold:
            released = self._released
            with self._lock:
                self.held += 1
            released.wait()
            with self._lock:
                self.held -= 1

    def service(self, details):
        method = details.method
        name = method.rsplit("/", 1)[-1]

        def md(context):
            return tuple(context.invocation_metadata())

        if name in _SERVER_STREAM:

            def us(request, context):
                self._check(method, context)
                yield from self._channel.unary_stream(method)(request, metadata=md(context))

            return grpc.unary_stream_rpc_method_handler(us)
        if name in _CLIENT_STREAM:

            def su(requests, context):
                self._check(method, context)
                return self._channel.stream_unary(method)(requests, metadata=md(context))

            return grpc.stream_unary_rpc_method_handler(su)

        def uu(request, context):
            self._check(method, context)
            return self._channel.unary_unary(method)(request, metadata=md(context))

        return grpc.unary_unary_rpc_method_handler(uu)
