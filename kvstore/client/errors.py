"""The client's error type. Every failed call of KVClient raises a KVClientError: a
grpc.RpcError with the same code() and details() the agent answered, whichever transport
carried the call (gRPC or the local lane), so callers written against grpc.RpcError keep
working. A call that ran past its deadline raises DeadlineExceeded (code()
DEADLINE_EXCEEDED), never hangs."""

from __future__ import annotations

import grpc

from kvstore.errors import UNKNOWN_REGION


class KVClientError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    @property
    def unknown_region(self) -> bool:
        """The agent does not know our shared-memory region (it restarted)."""
        return self._code == grpc.StatusCode.NOT_FOUND and self._details.startswith(UNKNOWN_REGION)


class DeadlineExceeded(KVClientError):
    def __init__(self, details: str) -> None:
        super().__init__(grpc.StatusCode.DEADLINE_EXCEEDED, details)


class StagingGone(KVClientError):
    """The agent refused to take our shared memory back (a cap of its own, FAILED_
    PRECONDITION) after the lane connection holding it closed: the client gave its staging
    area up and carries payloads over gRPC; a zero-copy call that needs it raises this."""

    def __init__(self, details: str) -> None:
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION, details)


def client_error(code: grpc.StatusCode, details: str) -> KVClientError:
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(details)
    return KVClientError(code, details)


def from_rpc(exc: grpc.RpcError) -> KVClientError:
    """A grpc.RpcError (from a stub call) as the client's own type."""
    if isinstance(exc, KVClientError):
        return exc
    code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
    return client_error(code or grpc.StatusCode.UNKNOWN, details or "")
