from kvstore.v1 import agent_pb2 as _agent_pb2
from kvstore.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FetchRequest(_message.Message):
    __slots__ = ("ns", "spec", "block_ids", "parent_id", "batch_blocks", "authorization", "same_host")
    NS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    AUTHORIZATION_FIELD_NUMBER: _ClassVar[int]
    SAME_HOST_FIELD_NUMBER: _ClassVar[int]
    ns: _agent_pb2.NamespaceRef
    spec: _common_pb2.Namespace
    block_ids: bytes
    parent_id: bytes
    batch_blocks: int
    authorization: str
    same_host: str
    def __init__(self, ns: _Optional[_Union[_agent_pb2.NamespaceRef, _Mapping]] = ..., spec: _Optional[_Union[_common_pb2.Namespace, _Mapping]] = ..., block_ids: _Optional[bytes] = ..., parent_id: _Optional[bytes] = ..., batch_blocks: _Optional[int] = ..., authorization: _Optional[str] = ..., same_host: _Optional[str] = ...) -> None: ...

class FetchChunk(_message.Message):
    __slots__ = ("first_index", "count", "checksums", "data", "done", "error", "error_code", "runs", "direct_pid", "addresses", "direct_fd", "direct_base", "direct_bytes")
    FIRST_INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    DIRECT_PID_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    DIRECT_FD_FIELD_NUMBER: _ClassVar[int]
    DIRECT_BASE_FIELD_NUMBER: _ClassVar[int]
    DIRECT_BYTES_FIELD_NUMBER: _ClassVar[int]
    first_index: int
    count: int
    checksums: _containers.RepeatedScalarFieldContainer[int]
    data: _containers.RepeatedScalarFieldContainer[bytes]
    done: bool
    error: str
    error_code: str
    runs: _containers.RepeatedScalarFieldContainer[int]
    direct_pid: int
    addresses: _containers.RepeatedScalarFieldContainer[int]
    direct_fd: int
    direct_base: int
    direct_bytes: int
    def __init__(self, first_index: _Optional[int] = ..., count: _Optional[int] = ..., checksums: _Optional[_Iterable[int]] = ..., data: _Optional[_Iterable[bytes]] = ..., done: _Optional[bool] = ..., error: _Optional[str] = ..., error_code: _Optional[str] = ..., runs: _Optional[_Iterable[int]] = ..., direct_pid: _Optional[int] = ..., addresses: _Optional[_Iterable[int]] = ..., direct_fd: _Optional[int] = ..., direct_base: _Optional[int] = ..., direct_bytes: _Optional[int] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("ns", "spec", "block_ids", "parent_id", "peer_address", "peer_ucx_address", "timeout_ms")
    NS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PEER_UCX_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    ns: _agent_pb2.NamespaceRef
    spec: _common_pb2.Namespace
    block_ids: bytes
    parent_id: bytes
    peer_address: str
    peer_ucx_address: str
    timeout_ms: int
    def __init__(self, ns: _Optional[_Union[_agent_pb2.NamespaceRef, _Mapping]] = ..., spec: _Optional[_Union[_common_pb2.Namespace, _Mapping]] = ..., block_ids: _Optional[bytes] = ..., parent_id: _Optional[bytes] = ..., peer_address: _Optional[str] = ..., peer_ucx_address: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("present", "fetched", "waited", "transport", "stopped")
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    FETCHED_FIELD_NUMBER: _ClassVar[int]
    WAITED_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    present: int
    fetched: int
    waited: int
    transport: str
    stopped: str
    def __init__(self, present: _Optional[int] = ..., fetched: _Optional[int] = ..., waited: _Optional[int] = ..., transport: _Optional[str] = ..., stopped: _Optional[str] = ...) -> None: ...
