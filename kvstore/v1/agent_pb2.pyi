from kvstore.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenNamespaceRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: _common_pb2.Namespace
    def __init__(self, spec: _Optional[_Union[_common_pb2.Namespace, _Mapping]] = ...) -> None: ...

class NamespaceInfo(_message.Message):
    __slots__ = ("namespace_id", "generation", "block_bytes", "policy", "tenant", "name")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    generation: int
    block_bytes: int
    policy: _common_pb2.NamespacePolicy
    tenant: str
    name: str
    def __init__(self, namespace_id: _Optional[bytes] = ..., generation: _Optional[int] = ..., block_bytes: _Optional[int] = ..., policy: _Optional[_Union[_common_pb2.NamespacePolicy, _Mapping]] = ..., tenant: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class NamespaceRef(_message.Message):
    __slots__ = ("namespace_id", "generation")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    generation: int
    def __init__(self, namespace_id: _Optional[bytes] = ..., generation: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("ns", "block_ids", "request_id", "caller_held")
    NS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CALLER_HELD_FIELD_NUMBER: _ClassVar[int]
    ns: NamespaceRef
    block_ids: bytes
    request_id: str
    caller_held: int
    def __init__(self, ns: _Optional[_Union[NamespaceRef, _Mapping]] = ..., block_ids: _Optional[bytes] = ..., request_id: _Optional[str] = ..., caller_held: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("matched", "hbm", "nvme", "generation")
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    HBM_FIELD_NUMBER: _ClassVar[int]
    NVME_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    matched: int
    hbm: int
    nvme: int
    generation: int
    def __init__(self, matched: _Optional[int] = ..., hbm: _Optional[int] = ..., nvme: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class ShmTarget(_message.Message):
    __slots__ = ("region_id", "offsets", "deadline_ns", "sent_ns")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_NS_FIELD_NUMBER: _ClassVar[int]
    SENT_NS_FIELD_NUMBER: _ClassVar[int]
    region_id: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    deadline_ns: int
    sent_ns: int
    def __init__(self, region_id: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ..., deadline_ns: _Optional[int] = ..., sent_ns: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("ns", "block_ids", "parent_id", "shm", "request_id")
    NS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ns: NamespaceRef
    block_ids: bytes
    parent_id: bytes
    shm: ShmTarget
    request_id: str
    def __init__(self, ns: _Optional[_Union[NamespaceRef, _Mapping]] = ..., block_ids: _Optional[bytes] = ..., parent_id: _Optional[bytes] = ..., shm: _Optional[_Union[ShmTarget, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("count", "first_index", "data", "checksums", "tiers")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    FIRST_INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    count: int
    first_index: int
    data: _containers.RepeatedScalarFieldContainer[bytes]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    tiers: _containers.RepeatedScalarFieldContainer[_common_pb2.Tier]
    def __init__(self, count: _Optional[int] = ..., first_index: _Optional[int] = ..., data: _Optional[_Iterable[bytes]] = ..., checksums: _Optional[_Iterable[int]] = ..., tiers: _Optional[_Iterable[_Union[_common_pb2.Tier, str]]] = ...) -> None: ...

class BlockPut(_message.Message):
    __slots__ = ("block_id", "parent_id", "data", "shm_offset", "checksum", "has_checksum")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    HAS_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    block_id: bytes
    parent_id: bytes
    data: bytes
    shm_offset: int
    checksum: int
    has_checksum: bool
    def __init__(self, block_id: _Optional[bytes] = ..., parent_id: _Optional[bytes] = ..., data: _Optional[bytes] = ..., shm_offset: _Optional[int] = ..., checksum: _Optional[int] = ..., has_checksum: _Optional[bool] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("ns", "shm_region_id", "blocks", "root", "chain_ids", "chain_parent_id", "chain_first_offset", "chain_stride", "staging_deadline_ns", "staging_sent_ns")
    NS_FIELD_NUMBER: _ClassVar[int]
    SHM_REGION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    CHAIN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAIN_PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIRST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    CHAIN_STRIDE_FIELD_NUMBER: _ClassVar[int]
    STAGING_DEADLINE_NS_FIELD_NUMBER: _ClassVar[int]
    STAGING_SENT_NS_FIELD_NUMBER: _ClassVar[int]
    ns: NamespaceRef
    shm_region_id: int
    blocks: _containers.RepeatedCompositeFieldContainer[BlockPut]
    root: bytes
    chain_ids: bytes
    chain_parent_id: bytes
    chain_first_offset: int
    chain_stride: int
    staging_deadline_ns: int
    staging_sent_ns: int
    def __init__(self, ns: _Optional[_Union[NamespaceRef, _Mapping]] = ..., shm_region_id: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[BlockPut, _Mapping]]] = ..., root: _Optional[bytes] = ..., chain_ids: _Optional[bytes] = ..., chain_parent_id: _Optional[bytes] = ..., chain_first_offset: _Optional[int] = ..., chain_stride: _Optional[int] = ..., staging_deadline_ns: _Optional[int] = ..., staging_sent_ns: _Optional[int] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored", "already_present", "not_stored")
    STORED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    NOT_STORED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    already_present: int
    not_stored: str
    def __init__(self, stored: _Optional[int] = ..., already_present: _Optional[int] = ..., not_stored: _Optional[str] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("ns", "block_ids")
    NS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    ns: NamespaceRef
    block_ids: bytes
    def __init__(self, ns: _Optional[_Union[NamespaceRef, _Mapping]] = ..., block_ids: _Optional[bytes] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("blocks", "pinned_bytes")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    pinned_bytes: int
    def __init__(self, blocks: _Optional[int] = ..., pinned_bytes: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "capacity_bytes", "used_bytes", "blocks", "slots_total", "slots_free", "condition", "unflushed_bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FREE_FIELD_NUMBER: _ClassVar[int]
    CONDITION_FIELD_NUMBER: _ClassVar[int]
    UNFLUSHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: _common_pb2.Tier
    capacity_bytes: int
    used_bytes: int
    blocks: int
    slots_total: int
    slots_free: int
    condition: str
    unflushed_bytes: int
    def __init__(self, tier: _Optional[_Union[_common_pb2.Tier, str]] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., slots_total: _Optional[int] = ..., slots_free: _Optional[int] = ..., condition: _Optional[str] = ..., unflushed_bytes: _Optional[int] = ...) -> None: ...

class TenantStats(_message.Message):
    __slots__ = ("tenant", "hbm_bytes", "nvme_bytes", "hbm_limit_bytes", "nvme_limit_bytes", "lookups", "lookup_hits", "lookup_blocks", "lookup_hit_blocks")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    HBM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NVME_BYTES_FIELD_NUMBER: _ClassVar[int]
    HBM_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    NVME_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_HITS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    hbm_bytes: int
    nvme_bytes: int
    hbm_limit_bytes: int
    nvme_limit_bytes: int
    lookups: int
    lookup_hits: int
    lookup_blocks: int
    lookup_hit_blocks: int
    def __init__(self, tenant: _Optional[str] = ..., hbm_bytes: _Optional[int] = ..., nvme_bytes: _Optional[int] = ..., hbm_limit_bytes: _Optional[int] = ..., nvme_limit_bytes: _Optional[int] = ..., lookups: _Optional[int] = ..., lookup_hits: _Optional[int] = ..., lookup_blocks: _Optional[int] = ..., lookup_hit_blocks: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("node_id", "device", "tiers", "tenants", "counters", "in_flight", "utilization", "native_accel")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    NATIVE_ACCEL_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    device: str
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStats]
    counters: _containers.ScalarMap[str, int]
    in_flight: int
    utilization: float
    native_accel: str
    def __init__(self, node_id: _Optional[str] = ..., device: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., tenants: _Optional[_Iterable[_Union[TenantStats, _Mapping]]] = ..., counters: _Optional[_Mapping[str, int]] = ..., in_flight: _Optional[int] = ..., utilization: _Optional[float] = ..., native_accel: _Optional[str] = ...) -> None: ...

class LocalLaneRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LocalLaneResponse(_message.Message):
    __slots__ = ("socket", "lane_id")
    SOCKET_FIELD_NUMBER: _ClassVar[int]
    LANE_ID_FIELD_NUMBER: _ClassVar[int]
    socket: str
    lane_id: bytes
    def __init__(self, socket: _Optional[str] = ..., lane_id: _Optional[bytes] = ...) -> None: ...

class RegisterShmRequest(_message.Message):
    __slots__ = ("name", "size", "device_uuid")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    device_uuid: bytes
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., device_uuid: _Optional[bytes] = ...) -> None: ...

class RegisterShmResponse(_message.Message):
    __slots__ = ("region_id", "local_socket", "chain_puts")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    CHAIN_PUTS_FIELD_NUMBER: _ClassVar[int]
    region_id: int
    local_socket: str
    chain_puts: bool
    def __init__(self, region_id: _Optional[int] = ..., local_socket: _Optional[str] = ..., chain_puts: _Optional[bool] = ...) -> None: ...

class UnregisterShmRequest(_message.Message):
    __slots__ = ("region_id",)
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    region_id: int
    def __init__(self, region_id: _Optional[int] = ...) -> None: ...

class UnregisterShmResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("subscriber",)
    SUBSCRIBER_FIELD_NUMBER: _ClassVar[int]
    subscriber: str
    def __init__(self, subscriber: _Optional[str] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("seq", "kind", "namespace_id", "block_ids", "parent_id", "tier", "generation")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[Event.Kind]
        STORED: _ClassVar[Event.Kind]
        REMOVED: _ClassVar[Event.Kind]
        NAMESPACE_CLEARED: _ClassVar[Event.Kind]
        TIER_CHANGED: _ClassVar[Event.Kind]
    KIND_UNSPECIFIED: Event.Kind
    STORED: Event.Kind
    REMOVED: Event.Kind
    NAMESPACE_CLEARED: Event.Kind
    TIER_CHANGED: Event.Kind
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    seq: int
    kind: Event.Kind
    namespace_id: bytes
    block_ids: bytes
    parent_id: bytes
    tier: _common_pb2.Tier
    generation: int
    def __init__(self, seq: _Optional[int] = ..., kind: _Optional[_Union[Event.Kind, str]] = ..., namespace_id: _Optional[bytes] = ..., block_ids: _Optional[bytes] = ..., parent_id: _Optional[bytes] = ..., tier: _Optional[_Union[_common_pb2.Tier, str]] = ..., generation: _Optional[int] = ...) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("node_id", "epoch", "snapshot", "snapshot_done", "events")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_DONE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: str
    snapshot: bool
    snapshot_done: bool
    events: _containers.RepeatedCompositeFieldContainer[Event]
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[str] = ..., snapshot: _Optional[bool] = ..., snapshot_done: _Optional[bool] = ..., events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ...) -> None: ...
