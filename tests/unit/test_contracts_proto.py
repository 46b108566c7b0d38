"""Proto <-> engine conversions (contracts/proto.py): the one pair each way that the router
and the engine services share (pure, no server)."""

from __future__ import annotations

import dataclasses

import pytest

from tandem.contracts.proto import (
    finish_reason_from_proto,
    finish_reason_to_proto,
    logprobs_to_proto,
    sampling_params_from_proto,
    sampling_params_to_proto,
)
from tandem.engine.request import Logprob
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sampling_params import StructuredOutputsParams as SO
from tandem.v1 import common_pb2

# Engine fields the proto does not carry on purpose (the router keeps them).
NOT_CARRIED = {"n", "stop", "include_stop_str_in_output",
               "skip_special_tokens", "spaces_between_special_tokens"}

# A value other than the default for every field the proto carries.
NON_DEFAULT = dict(temperature=0.5, top_k=7, top_p=0.875, min_p=0.125, seed=3,
                   presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.25,
                   logit_bias={5: 2.0}, min_tokens=2, max_tokens=9, ignore_eos=True,
                   stop_token_ids=[4], logprobs=0, prompt_logprobs=2,
                   structured_outputs=SO(json={"type": "object"}, disable_any_whitespace=True))


def test_unset_fields_take_engine_defaults():
    sp = sampling_params_from_proto(common_pb2.SamplingParams())
    default = SamplingParams()
    assert sp.temperature == default.temperature == 1.0
    assert sp.top_p == 1.0 and sp.top_k == -1 and sp.repetition_penalty == 1.0
    assert sp.seed is None and sp.logprobs is None and sp.logit_bias is None
    assert sp.max_tokens is None, "unset max_tokens means up to the context length"


def test_every_proto_field_is_an_engine_field_and_every_engine_field_is_accounted_for():
    """Bug pinned: the converters existed twice each way (router and services) and could
    drift apart; a field added to one side and not the other would be dropped silently."""
    proto_fields = {f.name for f in common_pb2.SamplingParams.DESCRIPTOR.fields}
    engine_fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert proto_fields <= engine_fields
    assert proto_fields | NOT_CARRIED == engine_fields
    assert set(NON_DEFAULT) == proto_fields


def test_round_trip_keeps_every_carried_field():
    # min_tokens and a constraint exclude each other: two requests carry every field.
    for left_out in ("structured_outputs", "min_tokens"):
        fields = {k: v for k, v in NON_DEFAULT.items() if k != left_out}
        back = sampling_params_from_proto(sampling_params_to_proto(SamplingParams(**fields)))
        for name, value in fields.items():
            assert getattr(back, name) == value, name
    assert sampling_params_from_proto(
        common_pb2.SamplingParams(temperature=0.0)).temperature == 0.0, "explicit 0 = greedy"


def test_text_side_fields_and_unset_max_tokens_come_from_the_caller():
    msg = sampling_params_to_proto(SamplingParams(max_tokens=None, stop=["x"]))
    assert not msg.HasField("max_tokens")
    sp = sampling_params_from_proto(msg, max_tokens_if_unset=12, stop=["END"],
                                    include_stop_str_in_output=True, skip_special_tokens=False)
    assert (sp.max_tokens, sp.stop, sp.include_stop_str_in_output) == (12, ["END"], True)
    assert sp.skip_special_tokens is False
    msg.max_tokens = 3
    assert sampling_params_from_proto(msg, max_tokens_if_unset=12).max_tokens == 3


@pytest.mark.parametrize("so", [
    SO(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
    SO(json_object=True), SO(regex="[a-z]+"), SO(choice=["x", 'y"z']),
    SO(grammar='root ::= "a"'), SO(regex="a", disable_any_whitespace=True)])
def test_structured_outputs_round_trip(so):
    msg = sampling_params_to_proto(SamplingParams(structured_outputs=so))
    assert msg.structured_outputs.WhichOneof("kind") == so.kind
    back = sampling_params_from_proto(msg).structured_outputs
    assert back is not None and back.cache_key() == so.cache_key()


def test_structured_outputs_bad_proto_names_the_field():
    msg = common_pb2.SamplingParams()
    msg.structured_outputs.choice.SetInParent()  # an empty choice list
    with pytest.raises(ValueError, match="structured_outputs.choice must not be empty"):
        sampling_params_from_proto(msg)
    msg = common_pb2.SamplingParams()
    msg.structured_outputs.disable_any_whitespace = True  # no kind
    with pytest.raises(ValueError, match="structured_outputs must set one of"):
        sampling_params_from_proto(msg)


def test_invalid_value_names_the_field():
    with pytest.raises(ValueError, match="repetition_penalty"):
        sampling_params_from_proto(common_pb2.SamplingParams(repetition_penalty=0.0))


@pytest.mark.parametrize("reason", [None, "stop", "length", "abort"])
def test_finish_reason_round_trip(reason):
    assert finish_reason_from_proto(finish_reason_to_proto(reason)) == reason


def test_finish_reason_unknown_values_are_rejected():
    with pytest.raises(ValueError, match="finish_reason"):
        finish_reason_to_proto("eos")
    with pytest.raises(ValueError, match="finish_reason"):
        finish_reason_from_proto(99)


def test_logprobs_sorted_and_sampled_outside_top_n():
    position = {1: Logprob(-0.1, 1), 2: Logprob(-2.0, 2), 9: Logprob(-5.0, 7)}
    msg = logprobs_to_proto(9, position, num_top=2)
    assert msg.sampled.token_id == 9 and msg.sampled.rank == 7
    assert [t.token_id for t in msg.top] == [1, 2]


def test_the_module_imports_no_torch():
    """The router converts with this module; it must not load torch."""
    import subprocess
    import sys

    code = ("import sys, tandem.contracts.proto; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
