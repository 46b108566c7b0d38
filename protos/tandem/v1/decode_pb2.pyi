from tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "first_token_id", "block_hashes", "sampling_params", "kv_layout_fingerprint", "hash_algorithm", "priority", "output_token_ids", "kv_publish_pending", "kv_publish_in_flight", "cache_salt", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_PUBLISH_PENDING_FIELD_NUMBER: _ClassVar[int]
    KV_PUBLISH_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_id: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    sampling_params: _common_pb2.SamplingParams
    kv_layout_fingerprint: bytes
    hash_algorithm: str
    priority: int
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_publish_pending: bool
    kv_publish_in_flight: _common_pb2.PublishInFlight
    cache_salt: str
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token_id: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., kv_layout_fingerprint: _Optional[bytes] = ..., hash_algorithm: _Optional[str] = ..., priority: _Optional[int] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., kv_publish_pending: _Optional[bool] = ..., kv_publish_in_flight: _Optional[_Union[_common_pb2.PublishInFlight, _Mapping]] = ..., cache_salt: _Optional[str] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "stop_token_id", "kv_pull_ns", "num_cached_tokens", "queue_ns", "kv_pull_bytes", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    KV_PULL_NS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_NS_FIELD_NUMBER: _ClassVar[int]
    KV_PULL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    finish_reason: _common_pb2.FinishReason
    stop_token_id: int
    kv_pull_ns: int
    num_cached_tokens: int
    queue_ns: int
    kv_pull_bytes: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., kv_pull_ns: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., queue_ns: _Optional[int] = ..., kv_pull_bytes: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ...) -> None: ...

class DecodeStreamRequest(_message.Message):
    __slots__ = ("stream", "start", "cancel")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    stream: int
    start: DecodeRequest
    cancel: bool
    def __init__(self, stream: _Optional[int] = ..., start: _Optional[_Union[DecodeRequest, _Mapping]] = ..., cancel: _Optional[bool] = ...) -> None: ...

class DecodeStreamError(_message.Message):
    __slots__ = ("code", "message", "field")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    field: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., field: _Optional[str] = ...) -> None: ...

class DecodeStreamItem(_message.Message):
    __slots__ = ("stream", "response", "error")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    stream: int
    response: DecodeResponse
    error: DecodeStreamError
    def __init__(self, stream: _Optional[int] = ..., response: _Optional[_Union[DecodeResponse, _Mapping]] = ..., error: _Optional[_Union[DecodeStreamError, _Mapping]] = ...) -> None: ...

class DecodeStreamResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[DecodeStreamItem]
    def __init__(self, items: _Optional[_Iterable[_Union[DecodeStreamItem, _Mapping]]] = ...) -> None: ...
