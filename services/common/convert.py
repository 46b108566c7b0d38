"""Conversions between tandem.v1 protobuf messages and engine objects.

Unset ``optional`` proto fields take the engine's defaults
(``tandem.engine.sampling_params.SamplingParams``), so a default-constructed
``tandem.v1.SamplingParams`` means the same as ``SamplingParams()``.
"""

from __future__ import annotations

from tandem.engine.request import PositionLogprobs
from tandem.engine.sampling_params import SamplingParams
from tandem.v1 import common_pb2

# proto field -> engine field, for scalar `optional` fields copied as they are.
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
    "max_tokens",
    "ignore_eos",
    "logprobs",
)

_FINISH_REASONS: dict[str | None, common_pb2.FinishReason] = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}


def sampling_params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Build validated engine ``SamplingParams`` from the proto.

    Raises:
        ValueError: a value outside its range, naming the field (from ``SamplingParams``).
    """
    kwargs: dict[str, object] = {}
    for name in _OPTIONAL_SCALARS:
        if msg.HasField(name):
            kwargs[name] = getattr(msg, name)
    if msg.logit_bias:
        kwargs["logit_bias"] = dict(msg.logit_bias)
    if msg.stop_token_ids:
        kwargs["stop_token_ids"] = list(msg.stop_token_ids)
    if "max_tokens" not in kwargs:
        kwargs["max_tokens"] = None  # proto: unset = up to the context length
    return SamplingParams(**kwargs)  # type: ignore[arg-type]


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """The proto form of engine ``SamplingParams`` (``n`` and stop strings are not carried)."""
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
    return msg


def logprobs_to_proto(
    token_id: int, position: PositionLogprobs, num_top: int
) -> common_pb2.TopLogprobs:
    """One generated position's logprobs as a proto.

    Args:
        token_id: the sampled token.
        position: token id -> Logprob for the sampled token and the top-N.
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


def finish_reason_to_proto(reason: str | None) -> common_pb2.FinishReason:
    """Engine finish reason ("stop" | "length" | "abort" | None) -> ``FinishReason`` value."""
    return _FINISH_REASONS[reason]


def check_token_ids(token_ids: list[int], vocab_size: int, field: str) -> None:
    """Raise ``ValueError`` naming ``field`` unless every id is in ``[0, vocab_size)``."""
    for i, tok in enumerate(token_ids):
        if not 0 <= tok < vocab_size:
            raise ValueError(f"{field}[{i}] = {tok} is outside the vocabulary [0, {vocab_size})")
