"""Per-namespace policy: TTL, minimum cacheable prefix, NVMe spill, pin budget."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvstore.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class NamespacePolicy:
    ttl_seconds: float = 0.0  # 0: no expiry; refreshed on every hit
    min_prefix_blocks: int = 1  # prompts with fewer full blocks are not cached
    persist: bool = True  # evicted blocks spill to NVMe instead of being dropped
    pin_budget_bytes: int = 0  # bytes this namespace may pin in the device pool

    def __post_init__(self) -> None:
        if self.ttl_seconds < 0:
            raise InvalidArgument("policy ttl_seconds must be >= 0")
        if self.min_prefix_blocks < 1:
            raise InvalidArgument("policy min_prefix_blocks must be >= 1")
        if self.pin_budget_bytes < 0:
            raise InvalidArgument("policy pin_budget_bytes must be >= 0")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "NamespacePolicy":
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidArgument("unknown policy fields: " + ", ".join(sorted(unknown)))
        return cls(**d)
