"""The request validator (engine/validation.py): each rule once, for engine, services and
router; every error names its field."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from tandem.engine.sampling_params import SamplingParams
from tandem.engine.validation import (
    ContextLengthError,
    KVCapacityError,
    RequestError,
    RequestLimits,
    check_context_length,
    check_prompt_token_ids,
    validate_request,
)

ENGINE = RequestLimits(max_model_len=64, vocab_size=100, max_kv_tokens=48, max_prefill_tokens=32)


@pytest.mark.parametrize(
    ("prompt", "params", "error", "field", "match"),
    [
        ([], {}, RequestError, "prompt_token_ids", "prompt_token_ids must not be empty"),
        (list(range(64)), {}, ContextLengthError, "prompt_token_ids",
         r"max_model_len 64 \(prompt_token_ids: 1..63"),
        ([1, 100], {}, RequestError, "prompt_token_ids", r"token id 100 outside \[0, 100\)"),
        ([-3, 1], {}, RequestError, "prompt_token_ids", "token id -3 outside"),
        ([1], {"logit_bias": {100: 1.0}}, RequestError, "logit_bias", "logit_bias token id"),
        ([1], {"stop_token_ids": [-1]}, RequestError, "stop_token_ids", "stop_token_ids entry"),
        (list(range(33)), {}, RequestError, "prompt_token_ids", "max_num_batched_tokens 32"),
    ],
)
def test_each_rule_names_its_field(prompt, params, error, field, match) -> None:
    with pytest.raises(error, match=match) as info:
        validate_request(prompt, SamplingParams(**params), ENGINE)
    assert info.value.field == field
    assert isinstance(info.value, ValueError)


def test_kv_capacity_is_its_own_error_and_comes_last() -> None:
    limits = RequestLimits(max_model_len=64, vocab_size=100, max_kv_tokens=16)
    with pytest.raises(KVCapacityError, match="KV cache"):
        validate_request(list(range(16)), SamplingParams(), limits)
    validate_request(list(range(15)), SamplingParams(), limits)  # one token still fits
    # A definitive mistake is reported before "no room here" (another engine may have room).
    with pytest.raises(RequestError) as info:
        validate_request(list(range(15)) + [100], SamplingParams(), limits)
    assert not isinstance(info.value, KVCapacityError)


def test_unknown_limits_are_not_checked() -> None:
    router = RequestLimits(max_model_len=64)
    validate_request([10**6] * 40, SamplingParams(stop_token_ids=[10**6]), router)
    with pytest.raises(ContextLengthError):
        validate_request([1] * 64, SamplingParams(), router)


def test_field_name_follows_the_callers_api() -> None:
    with pytest.raises(RequestError, match="prompt must not be empty") as info:
        check_prompt_token_ids([], 100, "prompt")
    assert info.value.field == "prompt"
    with pytest.raises(ContextLengthError) as info:
        validate_request([1] * 64, SamplingParams(), ENGINE, field="messages")
    assert info.value.field == "messages"


def test_context_length_with_max_tokens() -> None:
    check_context_length(10, 100, 90)
    with pytest.raises(ContextLengthError) as info:
        check_context_length(10, 100, 91, field="messages")
    assert info.value.field == "max_tokens"
    assert (info.value.num_prompt_tokens, info.value.max_tokens) == (10, 91)
    with pytest.raises(ContextLengthError) as info:
        check_context_length(100, 100, None, field="messages")
    assert info.value.field == "messages"


def test_sampling_params_errors_carry_the_field() -> None:
    for kwargs, field in [({"top_p": 0.0}, "top_p"), ({"min_tokens": 3, "max_tokens": 2},
                          "min_tokens"), ({"logit_bias": {5: 500}}, "logit_bias"),
                          ({"stop": [""]}, "stop"), ({"temperature": float("nan")},
                                                      "temperature")]:
        with pytest.raises(RequestError) as info:
            SamplingParams(**kwargs)
        assert info.value.field == field and str(info.value).startswith(field)


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="max_kv_tokens"):
        RequestLimits(max_model_len=8, max_kv_tokens=0)


def test_router_and_services_map_the_same_errors() -> None:
    """Bug pinned: the router, the services and the engine each wrote these rules (with
    their own messages and status codes); now all raise the engine's errors, mapped in
    one place on each side."""
    from tandem.services.common.errors import status_for
    from tandem.services.router.errors import to_openai_error

    err = to_openai_error(RequestError("stop_token_ids", "stop_token_ids entry 7 outside"))
    assert (err.status_code, err.param) == (400, "stop_token_ids")
    long = ContextLengthError("messages", "too long", num_prompt_tokens=9, max_tokens=None,
                              max_model_len=8)
    err = to_openai_error(long)
    assert (err.status_code, err.param, err.code) == (400, "messages", "context_length_exceeded")
    assert "maximum context length is 8 tokens" in err.message
    assert status_for(RequestError("top_p", "x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_for(KVCapacityError("prompt_token_ids", "x")) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED)
    # A dead worker process: the router retries or migrates the request elsewhere.
    from tandem.engine.errors import EngineDeadError

    assert status_for(EngineDeadError("worker process 1 died")) == grpc.StatusCode.UNAVAILABLE


def test_validator_imports_no_torch() -> None:
    """The router calls the validator; it must not load torch."""
    code = ("import sys, tandem.engine.validation, tandem.engine.sampling_params, "
            "tandem.engine.fan_out; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
