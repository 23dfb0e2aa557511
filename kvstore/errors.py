"""Error hierarchy of the core. The gRPC edge maps each class to one status code
(node_agent/interceptor), so the same failure reads the same everywhere."""

from __future__ import annotations


class KvError(Exception):
    """Base class; `code` names the gRPC status the edge returns."""

    code = "INTERNAL"


class InvalidArgument(KvError, ValueError):
    code = "INVALID_ARGUMENT"


class NotFound(KvError):
    code = "NOT_FOUND"


# NOT_FOUND details for a shared-memory region id the agent does not know: the agent
# restarted (or the client unregistered it). Same-host clients re-register on it.
UNKNOWN_REGION = "unknown shared-memory region"


class AlreadyExists(KvError):
    code = "ALREADY_EXISTS"


class FailedPrecondition(KvError):
    code = "FAILED_PRECONDITION"


class StaleGeneration(FailedPrecondition):
    """A request carried a namespace generation older than the one in force (fencing)."""


class ResourceExhausted(KvError):
    code = "RESOURCE_EXHAUSTED"


class PermissionDenied(KvError):
    code = "PERMISSION_DENIED"


class Unauthenticated(KvError):
    code = "UNAUTHENTICATED"


class Unavailable(KvError):
    code = "UNAVAILABLE"


class DeadlineExceeded(KvError):
    """The caller's deadline passed before the work could be done with its memory."""

    code = "DEADLINE_EXCEEDED"


class DataLoss(KvError):
    """Checksum mismatch or a corrupt record."""

    code = "DATA_LOSS"


class StartupError(Exception):
    """A server cannot start for a reason the operator must fix (the message says which);
    the process entry points print it as one line and exit 1, without a traceback."""


def clip(text: str, n: int = 80, bare: bool = False) -> str:
    """`text` as a message quotes a user's argument: repr'd (`bare`: as it is when it is
    printable with no surrounding spaces), cut to `n` characters past which it says how
    long it was, so a 100 kB argument is not echoed back whole."""
    shown = text if len(text) <= n else text[:n]
    quoted = shown if bare and text.isprintable() and text == text.strip() else repr(shown)
    return quoted if len(text) <= n else f"{quoted}… ({len(text)} chars)"


def shown(text: object) -> str:
    """`text` for the operator's terminal: every character that does not print (ESC, CR,
    newline, other control characters) as its escape (\\x1b, \\r, \\n), so that what etcd or
    an agent holds (a reason, an operator's login name) cannot move the cursor, recolour
    or rewrite what the terminal shows."""
    s = str(text)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in s)
