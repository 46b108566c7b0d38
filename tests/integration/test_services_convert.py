"""Proto <-> engine conversions of the services (pure, no server)."""

from __future__ import annotations

import pytest

from tandem.engine.request import Logprob
from tandem.engine.sampling_params import SamplingParams
from tandem.services.common.convert import (
    logprobs_to_proto,
    sampling_params_from_proto,
    sampling_params_to_proto,
)
from tandem.v1 import common_pb2


def test_unset_fields_take_engine_defaults():
    sp = sampling_params_from_proto(common_pb2.SamplingParams())
    default = SamplingParams()
    assert sp.temperature == default.temperature == 1.0
    assert sp.top_p == 1.0 and sp.top_k == -1 and sp.repetition_penalty == 1.0
    assert sp.seed is None and sp.logprobs is None
    assert sp.max_tokens is None, "unset max_tokens means up to the context length"


def test_round_trip_keeps_every_field():
    sp = SamplingParams(temperature=0.5, top_k=7, top_p=0.9, min_p=0.1, seed=3,
                        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                        logit_bias={5: 2.0}, min_tokens=2, max_tokens=9, ignore_eos=True,
                        stop_token_ids=[4], logprobs=0)
    back = sampling_params_from_proto(sampling_params_to_proto(sp))
    for name in ("temperature", "top_k", "top_p", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty"):
        assert getattr(back, name) == pytest.approx(getattr(sp, name)), name
    assert (back.seed, back.logit_bias, back.min_tokens, back.max_tokens) == (3, {5: 2.0}, 2, 9)
    assert (back.ignore_eos, back.stop_token_ids, back.logprobs) == (True, [4], 0)
    assert sampling_params_from_proto(
        common_pb2.SamplingParams(temperature=0.0)).temperature == 0.0, "explicit 0 = greedy"


def test_invalid_value_names_the_field():
    with pytest.raises(ValueError, match="repetition_penalty"):
        sampling_params_from_proto(common_pb2.SamplingParams(repetition_penalty=0.0))


def test_logprobs_sorted_and_sampled_outside_top_n():
    position = {1: Logprob(-0.1, 1), 2: Logprob(-2.0, 2), 9: Logprob(-5.0, 7)}
    msg = logprobs_to_proto(9, position, num_top=2)
    assert msg.sampled.token_id == 9 and msg.sampled.rank == 7
    assert [t.token_id for t in msg.top] == [1, 2]
