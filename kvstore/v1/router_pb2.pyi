from kvstore.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RouteWeights(_message.Message):
    __slots__ = ("recompute", "peer_fetch", "load", "utilization", "queue")
    RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    PEER_FETCH_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    recompute: float
    peer_fetch: float
    load: float
    utilization: float
    queue: float
    def __init__(self, recompute: _Optional[float] = ..., peer_fetch: _Optional[float] = ..., load: _Optional[float] = ..., utilization: _Optional[float] = ..., queue: _Optional[float] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("namespace_id", "generation", "block_ids", "weights", "request_id", "dry_run", "spec")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    generation: int
    block_ids: bytes
    weights: RouteWeights
    request_id: str
    dry_run: bool
    spec: _common_pb2.Namespace
    def __init__(self, namespace_id: _Optional[bytes] = ..., generation: _Optional[int] = ..., block_ids: _Optional[bytes] = ..., weights: _Optional[_Union[RouteWeights, _Mapping]] = ..., request_id: _Optional[str] = ..., dry_run: _Optional[bool] = ..., spec: _Optional[_Union[_common_pb2.Namespace, _Mapping]] = ...) -> None: ...

class Candidate(_message.Message):
    __slots__ = ("node_id", "address", "local_blocks", "peer_blocks", "peer_node_id", "recompute_blocks", "in_flight", "utilization", "cost", "recompute_cost", "peer_cost", "space_cost", "load_cost", "utilization_cost", "queued_blocks")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PEER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PEER_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_COST_FIELD_NUMBER: _ClassVar[int]
    PEER_COST_FIELD_NUMBER: _ClassVar[int]
    SPACE_COST_FIELD_NUMBER: _ClassVar[int]
    LOAD_COST_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_COST_FIELD_NUMBER: _ClassVar[int]
    QUEUED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    local_blocks: int
    peer_blocks: int
    peer_node_id: str
    recompute_blocks: int
    in_flight: int
    utilization: float
    cost: float
    recompute_cost: float
    peer_cost: float
    space_cost: float
    load_cost: float
    utilization_cost: float
    queued_blocks: float
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., local_blocks: _Optional[int] = ..., peer_blocks: _Optional[int] = ..., peer_node_id: _Optional[str] = ..., recompute_blocks: _Optional[int] = ..., in_flight: _Optional[int] = ..., utilization: _Optional[float] = ..., cost: _Optional[float] = ..., recompute_cost: _Optional[float] = ..., peer_cost: _Optional[float] = ..., space_cost: _Optional[float] = ..., load_cost: _Optional[float] = ..., utilization_cost: _Optional[float] = ..., queued_blocks: _Optional[float] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("node_id", "address", "matched_blocks", "candidates", "request_id", "peer_hint", "peer_address", "peer_transfer_address", "recompute_ms", "pull_fixed_ms", "pull_ms_per_block", "decide_us")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_HINT_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PEER_TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    PULL_FIXED_MS_FIELD_NUMBER: _ClassVar[int]
    PULL_MS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    DECIDE_US_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    matched_blocks: int
    candidates: _containers.RepeatedCompositeFieldContainer[Candidate]
    request_id: str
    peer_hint: str
    peer_address: str
    peer_transfer_address: str
    recompute_ms: float
    pull_fixed_ms: float
    pull_ms_per_block: float
    decide_us: float
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., matched_blocks: _Optional[int] = ..., candidates: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ..., request_id: _Optional[str] = ..., peer_hint: _Optional[str] = ..., peer_address: _Optional[str] = ..., peer_transfer_address: _Optional[str] = ..., recompute_ms: _Optional[float] = ..., pull_fixed_ms: _Optional[float] = ..., pull_ms_per_block: _Optional[float] = ..., decide_us: _Optional[float] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "prefill_done")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DONE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prefill_done: bool
    def __init__(self, request_id: _Optional[str] = ..., prefill_done: _Optional[bool] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "address", "peer_address", "device", "hbm_capacity_bytes", "nvme_capacity_bytes", "indexed_blocks", "synced")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HBM_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    NVME_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SYNCED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    peer_address: str
    device: str
    hbm_capacity_bytes: int
    nvme_capacity_bytes: int
    indexed_blocks: int
    synced: bool
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., peer_address: _Optional[str] = ..., device: _Optional[str] = ..., hbm_capacity_bytes: _Optional[int] = ..., nvme_capacity_bytes: _Optional[int] = ..., indexed_blocks: _Optional[int] = ..., synced: _Optional[bool] = ...) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ...) -> None: ...
