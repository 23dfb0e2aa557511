from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    HBM: _ClassVar[Tier]
    NVME: _ClassVar[Tier]
TIER_UNSPECIFIED: Tier
HBM: Tier
NVME: Tier

class Namespace(_message.Message):
    __slots__ = ("tenant", "name", "model_name", "model_revision", "adapter_id", "adapter_revision", "tokenizer_id", "tokenizer_revision", "rope_type", "rope_theta", "rope_scaling", "attention_impl", "kv_dtype", "prompt_template_version", "num_layers", "num_kv_heads", "head_dim", "tp_rank", "tp_size", "block_size", "public")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_REVISION_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_REVISION_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_REVISION_FIELD_NUMBER: _ClassVar[int]
    ROPE_TYPE_FIELD_NUMBER: _ClassVar[int]
    ROPE_THETA_FIELD_NUMBER: _ClassVar[int]
    ROPE_SCALING_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_IMPL_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEMPLATE_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    name: str
    model_name: str
    model_revision: str
    adapter_id: str
    adapter_revision: str
    tokenizer_id: str
    tokenizer_revision: str
    rope_type: str
    rope_theta: float
    rope_scaling: str
    attention_impl: str
    kv_dtype: str
    prompt_template_version: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_rank: int
    tp_size: int
    block_size: int
    public: bool
    def __init__(self, tenant: _Optional[str] = ..., name: _Optional[str] = ..., model_name: _Optional[str] = ..., model_revision: _Optional[str] = ..., adapter_id: _Optional[str] = ..., adapter_revision: _Optional[str] = ..., tokenizer_id: _Optional[str] = ..., tokenizer_revision: _Optional[str] = ..., rope_type: _Optional[str] = ..., rope_theta: _Optional[float] = ..., rope_scaling: _Optional[str] = ..., attention_impl: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., prompt_template_version: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., block_size: _Optional[int] = ..., public: _Optional[bool] = ...) -> None: ...

class NamespacePolicy(_message.Message):
    __slots__ = ("ttl_seconds", "min_prefix_blocks", "persist", "pin_budget_bytes")
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MIN_PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PERSIST_FIELD_NUMBER: _ClassVar[int]
    PIN_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    ttl_seconds: int
    min_prefix_blocks: int
    persist: bool
    pin_budget_bytes: int
    def __init__(self, ttl_seconds: _Optional[int] = ..., min_prefix_blocks: _Optional[int] = ..., persist: _Optional[bool] = ..., pin_budget_bytes: _Optional[int] = ...) -> None: ...
