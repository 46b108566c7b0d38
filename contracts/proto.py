"""Conversions between ``tandem.v1`` protobuf messages and engine values: one pair each way.

The router (building Prefill / Decode requests, reading the public ``Generate`` request)
and the engine services (reading those requests, answering them) use these and no copies
of their own, so the two sides of a message can never disagree about a field.

Unset ``optional`` proto fields take the engine's defaults
(``tandem.engine.sampling_params.SamplingParams``), so a default-constructed
``tandem.v1.SamplingParams`` means the same as ``SamplingParams()`` -- except
``max_tokens``, whose absence means "up to the context length" (``None``).

Imports no torch (the router loads this module): the engine's ``Logprob`` type is named
only for type checking.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tandem.contracts.block_key import PublishInFlight
from tandem.engine.sampling_params import (
    DEFAULTED_FIELDS,
    SamplingDefaults,
    SamplingParams,
    StructuredOutputsParams,
)
from tandem.v1 import common_pb2

if TYPE_CHECKING:
    from tandem.engine.request import PositionLogprobs

# proto field -> engine field of the same name, for scalar `optional` fields copied as they are.
_OPTIONAL_SCALARS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "logprobs",
    "prompt_logprobs",
)

_FINISH_TO_PROTO: dict[str | None, common_pb2.FinishReason] = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}
_FINISH_FROM_PROTO: dict[int, str | None] = {v: k for k, v in _FINISH_TO_PROTO.items()}


def sampling_params_from_proto(
    msg: common_pb2.SamplingParams,
    *,
    max_tokens_if_unset: int | None = None,
    stop: Sequence[str] = (),
    include_stop_str_in_output: bool = False,
    skip_special_tokens: bool = True,
    defaults: SamplingDefaults | None = None,
) -> SamplingParams:
    """Build validated engine ``SamplingParams`` from the proto.

    Args:
        msg: the proto; unset optional fields take ``defaults``' values where it has
            the field (temperature, top_p, top_k, min_p, repetition_penalty), else
            ``SamplingParams``' defaults.
        max_tokens_if_unset: ``max_tokens`` when the proto leaves it unset (``None``:
            up to the context length, which the engine fills in).
        stop / include_stop_str_in_output / skip_special_tokens: the text-side fields,
            which ``tandem.v1.SamplingParams`` does not carry (the router handles stop
            strings and detokenization; the public ``GenerateRequest`` has them beside it).

    Raises:
        ValueError: a value outside its range, naming the field (from ``SamplingParams``).
    """
    kwargs: dict[str, object] = {
        name: getattr(msg, name) for name in _OPTIONAL_SCALARS if msg.HasField(name)
    }
    kwargs.update((defaults or SamplingDefaults()).resolve(
        **{name: kwargs.get(name) for name in DEFAULTED_FIELDS}  # type: ignore[arg-type]
    ))
    if msg.HasField("structured_outputs"):
        kwargs["structured_outputs"] = structured_outputs_from_proto(msg.structured_outputs)
    return SamplingParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else max_tokens_if_unset,
        logit_bias=dict(msg.logit_bias) or None,
        stop_token_ids=list(msg.stop_token_ids),
        stop=list(stop),
        include_stop_str_in_output=include_stop_str_in_output,
        skip_special_tokens=skip_special_tokens,
        # each value has its field's type: copied from the proto field of the same name
        **kwargs,  # type: ignore[arg-type]
    )


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """The proto form of engine ``SamplingParams``.

    ``n`` is not carried (the router fans a request out into ``n`` single completions
    before any RPC, ``engine.fan_out``), nor are the text-side fields (stop strings,
    detokenization flags), which stay with the router.
    """
    msg = common_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        min_tokens=params.min_tokens,
        ignore_eos=params.ignore_eos,
        stop_token_ids=params.stop_token_ids,
        logit_bias=params.logit_bias or {},
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.max_tokens is not None:
        msg.max_tokens = params.max_tokens
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    if params.structured_outputs is not None:
        msg.structured_outputs.CopyFrom(structured_outputs_to_proto(params.structured_outputs))
    return msg


def structured_outputs_to_proto(so: StructuredOutputsParams) -> common_pb2.StructuredOutputs:
    """The proto form of a constraint: its kind in the ``oneof`` (a schema as its JSON text
    in the schema's own key order, ``StructuredOutputsParams.spec``)."""
    msg = common_pb2.StructuredOutputs(disable_any_whitespace=so.disable_any_whitespace)
    kind = so.kind
    if kind == "json":
        msg.json = so.spec()
    elif kind == "json_object":
        msg.json_object = True
    elif kind == "choice":
        msg.choice.choices.extend(so.choice or ())
    else:
        setattr(msg, kind, so.spec())
    if so.after_token_id is not None:
        msg.after_token_id = so.after_token_id
    return msg


def structured_outputs_from_proto(msg: common_pb2.StructuredOutputs) -> StructuredOutputsParams:
    """A constraint from its proto.

    Raises:
        RequestError: no kind set, or a value of the wrong shape (an empty choice list, a
            schema that is not JSON), naming ``structured_outputs.<kind>``.
    """
    kind = msg.WhichOneof("kind")
    common: dict[str, Any] = {
        "disable_any_whitespace": msg.disable_any_whitespace,
        "after_token_id": msg.after_token_id if msg.HasField("after_token_id") else None}
    if kind == "choice":
        return StructuredOutputsParams(choice=tuple(msg.choice.choices), **common)
    if kind is None:
        return StructuredOutputsParams(**common)  # raises, naming the field
    return StructuredOutputsParams(**{kind: getattr(msg, kind)}, **common)


def finish_reason_to_proto(reason: str | None) -> common_pb2.FinishReason:
    """Engine finish reason ("stop" | "length" | "abort" | ``None``) -> ``FinishReason``.

    Raises:
        ValueError: any other reason.
    """
    try:
        return _FINISH_TO_PROTO[reason]
    except KeyError:
        raise ValueError(f"finish_reason {reason!r} is not one of stop, length, abort") from None


def finish_reason_from_proto(value: int) -> str | None:
    """``FinishReason`` -> engine finish reason (``FINISH_REASON_UNSPECIFIED``: ``None``).

    Raises:
        ValueError: a value this version of ``tandem.v1`` does not define.
    """
    try:
        return _FINISH_FROM_PROTO[value]
    except KeyError:
        raise ValueError(f"finish_reason {value} is not a tandem.v1.FinishReason") from None


def logprobs_to_proto(
    token_id: int, position: PositionLogprobs, num_top: int
) -> common_pb2.TopLogprobs:
    """One generated position's logprobs as a proto.

    Args:
        token_id: the sampled token.
        position: token id -> ``Logprob`` for the sampled token and the top-N.
        num_top: N, ``SamplingParams.logprobs``.

    Returns:
        ``TopLogprobs`` with ``sampled`` and the ``num_top`` most likely tokens,
        most likely first.
    """
    msg = common_pb2.TopLogprobs()
    msg.sampled.token_id = token_id
    sampled = position.get(token_id)
    if sampled is not None:
        msg.sampled.logprob = sampled.logprob
        if sampled.rank is not None:
            msg.sampled.rank = sampled.rank
    ranked = sorted(position.items(), key=lambda item: -item[1].logprob)[:num_top]
    for tok, lp in ranked:
        entry = msg.top.add(token_id=tok, logprob=lp.logprob)
        if lp.rank is not None:
            entry.rank = lp.rank
    return msg


def prompt_logprobs_to_proto(
    prompt_token_ids: Sequence[int], entries: Sequence[PositionLogprobs | None], num_top: int
) -> list[common_pb2.TopLogprobs]:
    """A request's prompt logprobs (``EngineCoreOutput.prompt_logprobs``: ``None`` for
    token 0, then one entry per prompt token) as protos, one per prompt token from the
    second on (``sampled``: that prompt token; ``top``: the ``num_top`` most likely).

    Raises:
        ValueError: naming ``prompt_logprobs`` when an entry is missing (one per prompt
            token after the first is expected).
    """
    if len(entries) != len(prompt_token_ids) or any(e is None for e in entries[1:]):
        raise ValueError(f"prompt_logprobs: {len(entries)} entries for "
                         f"{len(prompt_token_ids)} prompt tokens, or one missing")
    return [logprobs_to_proto(tok, pos, num_top)  # type: ignore[arg-type]
            for tok, pos in zip(prompt_token_ids[1:], entries[1:], strict=True)]


def publish_in_flight_to_proto(hint: PublishInFlight) -> common_pb2.PublishInFlight:
    """``PublishInFlight`` -> ``tandem.v1.PublishInFlight``."""
    return common_pb2.PublishInFlight(
        request_id=hint.request_id, kv_layout_fingerprint=hint.layout_fingerprint,
        block_size=hint.block_size, first_block=hint.first_block, end_block=hint.end_block)


def publish_in_flight_from_proto(msg: common_pb2.PublishInFlight) -> PublishInFlight:
    """``tandem.v1.PublishInFlight`` -> ``PublishInFlight``.

    Raises:
        ValueError: naming the field (``kv_publish_in_flight.<field>``) that is out of range.
    """
    return PublishInFlight(msg.request_id, bytes(msg.kv_layout_fingerprint), msg.block_size,
                           msg.first_block, msg.end_block)
