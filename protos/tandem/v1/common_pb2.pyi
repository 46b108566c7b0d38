from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "max_tokens", "ignore_eos", "stop_token_ids", "logprobs", "structured_outputs", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    max_tokens: int
    ignore_eos: bool
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: int
    structured_outputs: StructuredOutputs
    prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[int] = ..., structured_outputs: _Optional[_Union[StructuredOutputs, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("json", "json_object", "regex", "choice", "grammar", "disable_any_whitespace", "after_token_id")
    JSON_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    DISABLE_ANY_WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    AFTER_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    json: str
    json_object: bool
    regex: str
    choice: ChoiceList
    grammar: str
    disable_any_whitespace: bool
    after_token_id: int
    def __init__(self, json: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., grammar: _Optional[str] = ..., disable_any_whitespace: _Optional[bool] = ..., after_token_id: _Optional[int] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("sampled", "top")
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    sampled: TokenLogprob
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, sampled: _Optional[_Union[TokenLogprob, _Mapping]] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class RequestTimings(_message.Message):
    __slots__ = ("ttft_ns", "prefill_queue_ns", "prefill_compute_ns", "kv_publish_ns", "kv_pull_ns", "e2e_ns", "decode_tokens")
    TTFT_NS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUE_NS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COMPUTE_NS_FIELD_NUMBER: _ClassVar[int]
    KV_PUBLISH_NS_FIELD_NUMBER: _ClassVar[int]
    KV_PULL_NS_FIELD_NUMBER: _ClassVar[int]
    E2E_NS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ttft_ns: int
    prefill_queue_ns: int
    prefill_compute_ns: int
    kv_publish_ns: int
    kv_pull_ns: int
    e2e_ns: int
    decode_tokens: int
    def __init__(self, ttft_ns: _Optional[int] = ..., prefill_queue_ns: _Optional[int] = ..., prefill_compute_ns: _Optional[int] = ..., kv_publish_ns: _Optional[int] = ..., kv_pull_ns: _Optional[int] = ..., e2e_ns: _Optional[int] = ..., decode_tokens: _Optional[int] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("num_running_requests", "num_waiting_requests", "kv_cache_usage", "num_free_blocks", "num_total_blocks", "prefix_cache_hit_rate", "role", "model", "block_size", "kv_layout_fingerprint", "num_kv_load_failures", "kv_publish_output", "max_model_len_tokens", "vocab_size_tokens", "architecture", "model_impl")
    NUM_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_LOAD_FAILURES_FIELD_NUMBER: _ClassVar[int]
    KV_PUBLISH_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    MODEL_IMPL_FIELD_NUMBER: _ClassVar[int]
    num_running_requests: int
    num_waiting_requests: int
    kv_cache_usage: float
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_hit_rate: float
    role: str
    model: str
    block_size: int
    kv_layout_fingerprint: bytes
    num_kv_load_failures: int
    kv_publish_output: bool
    max_model_len_tokens: int
    vocab_size_tokens: int
    architecture: str
    model_impl: str
    def __init__(self, num_running_requests: _Optional[int] = ..., num_waiting_requests: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., prefix_cache_hit_rate: _Optional[float] = ..., role: _Optional[str] = ..., model: _Optional[str] = ..., block_size: _Optional[int] = ..., kv_layout_fingerprint: _Optional[bytes] = ..., num_kv_load_failures: _Optional[int] = ..., kv_publish_output: _Optional[bool] = ..., max_model_len_tokens: _Optional[int] = ..., vocab_size_tokens: _Optional[int] = ..., architecture: _Optional[str] = ..., model_impl: _Optional[str] = ...) -> None: ...

class PublishInFlight(_message.Message):
    __slots__ = ("request_id", "kv_layout_fingerprint", "block_size", "first_block", "end_block")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    END_BLOCK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kv_layout_fingerprint: bytes
    block_size: int
    first_block: int
    end_block: int
    def __init__(self, request_id: _Optional[str] = ..., kv_layout_fingerprint: _Optional[bytes] = ..., block_size: _Optional[int] = ..., first_block: _Optional[int] = ..., end_block: _Optional[int] = ...) -> None: ...
