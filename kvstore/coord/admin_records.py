"""The control plane's records (kvstore/coord/admin.py): the keys it adds under the
EtcdClient prefix and what they hold (members' acknowledgements of a flush or of the kill
switch, quotas, audit records), and the reports and progress of its actions, as kvctl
shows them."""

from __future__ import annotations

import getpass
import json
import os
import socket
from dataclasses import asdict, dataclass, field

from kvstore import errors
from kvstore.coord.records import json_object
from kvstore.errors import clip
from kvstore.units import format_size


ACKS = "acks/"
NAME_ACKS = "name-acks/"
SWITCH_ACKS = "switch-acks/"
ROUTERS = "routers/"
AUDIT = "audit/"
ROUTER_MEMBER = "router:"
# What the audit record of a flush or kill switch change says from its commit until kvctl
# rewrites it with the outcome (it stays so when kvctl was killed or etcd went away).
UNCONFIRMED = "committed; acknowledgements unconfirmed (kvctl has not reported them)"


class CommittedUnconfirmed(errors.Unavailable):
    """etcd became unreachable after a flush or kill switch change was committed: the
    change is in force in etcd, its acknowledgements are unconfirmed. `last` is the last
    progress seen (None: none was read)."""

    def __init__(self, msg: str, revision: int, last: "AckProgress | None") -> None:
        super().__init__(msg)
        self.revision = revision
        self.last = last


def router_member(router_id: str) -> str:
    return ROUTER_MEMBER + router_id


def ack_key(tenant: str, ns_hex: str, member: str) -> str:
    return f"{ACKS}{tenant}/{ns_hex}/{member}"


def marker_name(target: str) -> str:
    """The flush marker of `kvctl flush TENANT/TARGET`: the name, or a namespace id in
    lowercase hex (agents match either against their specs)."""
    lower = target.lower()
    return lower if len(lower) == 32 and all(c in "0123456789abcdef" for c in lower) else target


def name_ack_key(tenant: str, name: str, member: str) -> str:
    return f"{NAME_ACKS}{tenant}/{name}/{member}"


def default_operator() -> str:
    """Who the audit log names: $KVSTORE_OPERATOR, else user@host."""
    who = os.environ.get("KVSTORE_OPERATOR", "").strip()
    if who:
        return who
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid{os.getuid()}"
    return f"{user}@{socket.gethostname()}"


# ------------------------------------------------------------------------- records
@dataclass(frozen=True, slots=True)
class Ack:
    """A member's acknowledgement of a namespace generation."""

    generation: int
    dropped: int = 0  # blocks of older generations it dropped

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def parse(cls, raw: bytes) -> "Ack":
        if raw.strip().isdigit():  # a bare generation is accepted too
            return cls(int(raw))
        d = json_object(raw, "ack")
        return cls(int(d["generation"]), int(d.get("dropped", 0)))


@dataclass(frozen=True, slots=True)
class NameAck:
    """A member's acknowledgement of a flush by name (the marker's revision): its own
    unregistered copies of the name are flushed."""

    revision: int
    flushed: int = 0  # unregistered namespaces of that name it flushed
    dropped: int = 0  # their blocks it dropped

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def parse(cls, raw: bytes) -> "NameAck":
        d = json_object(raw, "name ack")
        return cls(int(d["revision"]), int(d.get("flushed", 0)), int(d.get("dropped", 0)))


@dataclass(frozen=True, slots=True)
class SwitchAck:
    """A member's acknowledgement of the kill switch state as of an etcd revision."""

    enabled: bool
    revision: int

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def parse(cls, raw: bytes) -> "SwitchAck":
        d = json_object(raw, "kill switch ack")
        return cls(bool(d["enabled"]), int(d["revision"]))


MAX_QUOTA_BYTES = 2**64 - 1


@dataclass(frozen=True, slots=True)
class Quota:
    """Per-node byte limits of one tenant; None: not set here (the agent's configured
    limit applies), 0: explicitly unlimited."""

    hbm_limit_bytes: int | None = None
    nvme_limit_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("hbm_limit_bytes", "nvme_limit_bytes"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"quota {name} must be a byte count >= 0, got {v!r}")
            if v is not None and v > MAX_QUOTA_BYTES:  # the agents report limits as uint64
                raise ValueError(
                    f"quota {name} must be at most {MAX_QUOTA_BYTES} bytes, got "
                    f"{clip(str(v), bare=True)}"
                )

    def merged(self, other: "Quota") -> "Quota":
        """`other`'s fields where set, ours elsewhere."""
        return Quota(
            *(
                o if o is not None else s
                for s, o in (
                    (self.hbm_limit_bytes, other.hbm_limit_bytes),
                    (self.nvme_limit_bytes, other.nvme_limit_bytes),
                )
            )
        )

    def to_json(self) -> bytes:
        return json.dumps(
            {k: v for k, v in asdict(self).items() if v is not None}, sort_keys=True
        ).encode()

    @classmethod
    def parse(cls, raw: bytes) -> "Quota":
        d = json_object(raw, "tenant quota")
        return cls(d.get("hbm_limit_bytes"), d.get("nvme_limit_bytes"))

    def describe(self) -> str:
        def one(v):
            return "(agent config)" if v is None else "unlimited" if v == 0 else format_size(v)

        return f"hbm {one(self.hbm_limit_bytes)}, nvme {one(self.nvme_limit_bytes)}"


_LATEST_AT = 253402300800  # 10000-01-01: the first second time.gmtime cannot show


@dataclass(frozen=True, slots=True)
class AuditRecord:
    at: float  # unix seconds, from 0 to _LATEST_AT
    who: str
    action: str  # flush | killswitch | quota-set | quota-clear
    target: str
    ok: bool
    result: str
    params: dict = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def parse(cls, raw: bytes) -> "AuditRecord":
        """ValueError (or KeyError, TypeError) for a record that is not one, its time
        included: a number of seconds a calendar can show (kvctl audit prints it)."""
        d = json_object(raw, "audit record")
        at = d["at"]
        if isinstance(at, bool) or not isinstance(at, (int, float)):
            raise ValueError(f"audit record's at is not a number of seconds: {clip(repr(at))}")
        if not 0 <= at < _LATEST_AT:
            raise ValueError(f"audit record's at is out of range: {clip(repr(at))}")
        return cls(
            float(at),
            str(d["who"]),
            str(d["action"]),
            str(d["target"]),
            bool(d["ok"]),
            str(d["result"]),
            dict(d.get("params") or {}),
        )


@dataclass(frozen=True, slots=True)
class FlushedNamespace:
    ns_hex: str
    name: str
    old_generation: int
    new_generation: int


@dataclass(frozen=True, slots=True)
class AckProgress:
    """Where an acknowledgement wait stands: live members, who acknowledged, who not."""

    members: tuple[str, ...]
    acked: tuple[str, ...]
    missing: tuple[str, ...]
    dropped: int = 0
    unregistered: int = 0  # flush: namespaces without an etcd record flushed on agents
    # Members live at some poll of this wait that left (lease expired or revoked) without
    # acknowledging. They no longer count: each fences itself while its lease is not
    # confirmed and re-reads the generations before it serves hits again
    # (kvstore/coord/fence.py), so they cannot serve the old generation either.
    left: tuple[str, ...] = ()

    @property
    def done(self) -> bool:
        return not self.missing


@dataclass(frozen=True, slots=True)
class FlushReport:
    tenant: str
    name: str
    namespaces: tuple[FlushedNamespace, ...]
    revision: int  # etcd revision of the flush transaction
    progress: AckProgress
    elapsed_s: float
    audit_key: str

    @property
    def ok(self) -> bool:
        return self.progress.done


@dataclass(frozen=True, slots=True)
class SwitchReport:
    enabled: bool
    reason: str
    revision: int
    progress: AckProgress
    elapsed_s: float
    changed: bool = True  # False: off when it was off already (nothing written)
    was_on: dict | None = None  # on when it was on already: the record it replaced

    @property
    def ok(self) -> bool:
        return self.progress.done
