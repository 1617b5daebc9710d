from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "max_tokens", "decode_instance_id", "predicted_lo", "predicted_hi", "resumed_tokens", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_LO_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_HI_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    decode_instance_id: str
    predicted_lo: int
    predicted_hi: int
    resumed_tokens: int
    sampling: Sampling
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., decode_instance_id: _Optional[str] = ..., predicted_lo: _Optional[int] = ..., predicted_hi: _Optional[int] = ..., resumed_tokens: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "stop_token_ids", "ignore_eos")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    presence_penalty: float
    frequency_penalty: float
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class KVHandle(_message.Message):
    __slots__ = ("request_id", "num_tokens", "num_bytes", "source_instance_id", "params")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_tokens: int
    num_bytes: int
    source_instance_id: str
    params: _containers.ScalarMap[str, str]
    def __init__(self, request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., num_bytes: _Optional[int] = ..., source_instance_id: _Optional[str] = ..., params: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Handoff(_message.Message):
    __slots__ = ("decode_instance_id", "decode_address")
    DECODE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    decode_instance_id: str
    decode_address: str
    def __init__(self, decode_instance_id: _Optional[str] = ..., decode_address: _Optional[str] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("request_id", "token_ids", "finished", "finish_reason", "handoff", "error", "kv_loaded_tokens", "call", "cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    KV_LOADED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    finish_reason: str
    handoff: Handoff
    error: str
    kv_loaded_tokens: int
    call: int
    cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., handoff: _Optional[_Union[Handoff, _Mapping]] = ..., error: _Optional[str] = ..., kv_loaded_tokens: _Optional[int] = ..., call: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class ServeUp(_message.Message):
    __slots__ = ("call", "generate", "attach", "close", "accept")
    CALL_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_FIELD_NUMBER: _ClassVar[int]
    call: int
    generate: GenerateRequest
    attach: AttachRequest
    close: bool
    accept: AcceptRequest
    def __init__(self, call: _Optional[int] = ..., generate: _Optional[_Union[GenerateRequest, _Mapping]] = ..., attach: _Optional[_Union[AttachRequest, _Mapping]] = ..., close: _Optional[bool] = ..., accept: _Optional[_Union[AcceptRequest, _Mapping]] = ...) -> None: ...

class ServeUps(_message.Message):
    __slots__ = ("ups",)
    UPS_FIELD_NUMBER: _ClassVar[int]
    ups: _containers.RepeatedCompositeFieldContainer[ServeUp]
    def __init__(self, ups: _Optional[_Iterable[_Union[ServeUp, _Mapping]]] = ...) -> None: ...

class ServeDown(_message.Message):
    __slots__ = ("chunks", "replies", "token_calls", "token_counts", "tokens")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[TokenChunk]
    replies: _containers.RepeatedCompositeFieldContainer[AcceptReply]
    token_calls: _containers.RepeatedScalarFieldContainer[int]
    token_counts: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, chunks: _Optional[_Iterable[_Union[TokenChunk, _Mapping]]] = ..., replies: _Optional[_Iterable[_Union[AcceptReply, _Mapping]]] = ..., token_calls: _Optional[_Iterable[int]] = ..., token_counts: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class AcceptRequest(_message.Message):
    __slots__ = ("request", "first_token", "kv")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    first_token: int
    kv: KVHandle
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., first_token: _Optional[int] = ..., kv: _Optional[_Union[KVHandle, _Mapping]] = ...) -> None: ...

class AcceptReply(_message.Message):
    __slots__ = ("accepted", "reason", "call")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    call: int
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., call: _Optional[int] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class FlipRequest(_message.Message):
    __slots__ = ("to_role",)
    TO_ROLE_FIELD_NUMBER: _ClassVar[int]
    to_role: str
    def __init__(self, to_role: _Optional[str] = ...) -> None: ...

class FlipReply(_message.Message):
    __slots__ = ("ok", "reason", "drained_at")
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DRAINED_AT_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    reason: str
    drained_at: float
    def __init__(self, ok: _Optional[bool] = ..., reason: _Optional[str] = ..., drained_at: _Optional[float] = ...) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ("order", "clear")
    ORDER_FIELD_NUMBER: _ClassVar[int]
    CLEAR_FIELD_NUMBER: _ClassVar[int]
    order: _containers.RepeatedScalarFieldContainer[str]
    clear: bool
    def __init__(self, order: _Optional[_Iterable[str]] = ..., clear: _Optional[bool] = ...) -> None: ...

class PlanReply(_message.Message):
    __slots__ = ("ok", "reason")
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    reason: str
    def __init__(self, ok: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("instance_id", "role", "model", "max_model_len", "load")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    role: str
    model: str
    max_model_len: int
    load: LoadReport
    def __init__(self, instance_id: _Optional[str] = ..., role: _Optional[str] = ..., model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., load: _Optional[_Union[LoadReport, _Mapping]] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("instance_id", "role", "state", "queued", "running", "kv_used_tokens", "kv_capacity_tokens", "tokens_per_s", "preemptions", "timestamp", "heavy", "light", "predicted_growth_tokens", "policy_version", "held_kv_tokens", "prefix_query_tokens", "prefix_hit_tokens", "cache")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    HEAVY_FIELD_NUMBER: _ClassVar[int]
    LIGHT_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_GROWTH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    HELD_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    role: str
    state: str
    queued: int
    running: int
    kv_used_tokens: int
    kv_capacity_tokens: int
    tokens_per_s: float
    preemptions: int
    timestamp: float
    heavy: int
    light: int
    predicted_growth_tokens: int
    policy_version: int
    held_kv_tokens: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    cache: CacheEvents
    def __init__(self, instance_id: _Optional[str] = ..., role: _Optional[str] = ..., state: _Optional[str] = ..., queued: _Optional[int] = ..., running: _Optional[int] = ..., kv_used_tokens: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., preemptions: _Optional[int] = ..., timestamp: _Optional[float] = ..., heavy: _Optional[int] = ..., light: _Optional[int] = ..., predicted_growth_tokens: _Optional[int] = ..., policy_version: _Optional[int] = ..., held_kv_tokens: _Optional[int] = ..., prefix_query_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., cache: _Optional[_Union[CacheEvents, _Mapping]] = ...) -> None: ...

class CacheEvents(_message.Message):
    __slots__ = ("epoch", "seq", "reset", "stored", "removed", "block_size")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    seq: int
    reset: bool
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    def __init__(self, epoch: _Optional[int] = ..., seq: _Optional[int] = ..., reset: _Optional[bool] = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("instance_id", "role", "address", "model", "max_model_len", "kv_capacity_tokens", "vocab_size", "tokenizer", "block_size")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    role: str
    address: str
    model: str
    max_model_len: int
    kv_capacity_tokens: int
    vocab_size: int
    tokenizer: str
    block_size: int
    def __init__(self, instance_id: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ..., vocab_size: _Optional[int] = ..., tokenizer: _Optional[str] = ..., block_size: _Optional[int] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("accepted", "reason", "report_interval_s")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REPORT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    report_interval_s: float
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., report_interval_s: _Optional[float] = ...) -> None: ...

class DecodeInstanceLoad(_message.Message):
    __slots__ = ("instance_id", "address", "load", "model")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    address: str
    load: LoadReport
    model: str
    def __init__(self, instance_id: _Optional[str] = ..., address: _Optional[str] = ..., load: _Optional[_Union[LoadReport, _Mapping]] = ..., model: _Optional[str] = ...) -> None: ...

class DecodeLoadBroadcast(_message.Message):
    __slots__ = ("instances", "timestamp", "policies_json", "policy_version")
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    POLICIES_JSON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[DecodeInstanceLoad]
    timestamp: float
    policies_json: str
    policy_version: int
    def __init__(self, instances: _Optional[_Iterable[_Union[DecodeInstanceLoad, _Mapping]]] = ..., timestamp: _Optional[float] = ..., policies_json: _Optional[str] = ..., policy_version: _Optional[int] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("front_id",)
    FRONT_ID_FIELD_NUMBER: _ClassVar[int]
    front_id: str
    def __init__(self, front_id: _Optional[str] = ...) -> None: ...

class InstanceView(_message.Message):
    __slots__ = ("registration", "state", "load")
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    registration: RegisterRequest
    state: str
    load: LoadReport
    def __init__(self, registration: _Optional[_Union[RegisterRequest, _Mapping]] = ..., state: _Optional[str] = ..., load: _Optional[_Union[LoadReport, _Mapping]] = ...) -> None: ...

class ClusterView(_message.Message):
    __slots__ = ("instances", "policies_json", "policy_version", "clock_now", "time_scale", "admin_url", "settled", "cache", "cache_snapshot", "cache_only")
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    POLICIES_JSON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    CLOCK_NOW_FIELD_NUMBER: _ClassVar[int]
    TIME_SCALE_FIELD_NUMBER: _ClassVar[int]
    ADMIN_URL_FIELD_NUMBER: _ClassVar[int]
    SETTLED_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    CACHE_ONLY_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[InstanceView]
    policies_json: str
    policy_version: int
    clock_now: float
    time_scale: float
    admin_url: str
    settled: bool
    cache: _containers.RepeatedCompositeFieldContainer[CacheChange]
    cache_snapshot: bool
    cache_only: bool
    def __init__(self, instances: _Optional[_Iterable[_Union[InstanceView, _Mapping]]] = ..., policies_json: _Optional[str] = ..., policy_version: _Optional[int] = ..., clock_now: _Optional[float] = ..., time_scale: _Optional[float] = ..., admin_url: _Optional[str] = ..., settled: _Optional[bool] = ..., cache: _Optional[_Iterable[_Union[CacheChange, _Mapping]]] = ..., cache_snapshot: _Optional[bool] = ..., cache_only: _Optional[bool] = ...) -> None: ...

class CacheChange(_message.Message):
    __slots__ = ("instance_id", "reset", "dropped", "stored", "removed")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    reset: bool
    dropped: bool
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, instance_id: _Optional[str] = ..., reset: _Optional[bool] = ..., dropped: _Optional[bool] = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ...) -> None: ...
