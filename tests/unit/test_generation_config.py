"""``--generation-config``: which default sampling values a model folder's
``generation_config.json`` gives (engine/generation_config.py), and how a request's own
values and the context length combine with them (router protocol, gRPC proto)."""

from __future__ import annotations

import json

import pytest

from tandem.contracts.proto import sampling_params_from_proto
from tandem.engine.generation_config import load_sampling_defaults
from tandem.engine.sampling_params import SamplingDefaults
from tandem.services.router.protocol import CompletionRequest
from tandem.v1 import common_pb2


def folder_with(tmp_path, config: dict):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_auto_reads_the_sampling_fields_of_the_models_file(tmp_path) -> None:
    folder = folder_with(tmp_path, {"bos_token_id": 1, "do_sample": True, "temperature": 0.7,
                                    "top_p": 0.8, "top_k": 20, "min_p": 0.05,
                                    "repetition_penalty": 1.05, "max_new_tokens": 64})
    d = load_sampling_defaults("auto", folder)
    assert (d.temperature, d.top_p, d.top_k, d.min_p, d.repetition_penalty, d.max_tokens) == (
        0.7, 0.8, 20, 0.05, 1.05, 64)
    assert d.source == str(tmp_path / "generation_config.json")
    assert d.overridden() == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.05,
                              "repetition_penalty": 1.05, "max_tokens": 64}
    # 'vllm' ignores the file; an explicit folder reads it from there
    assert load_sampling_defaults("vllm", folder) == SamplingDefaults()
    assert load_sampling_defaults(folder, None).temperature == 0.7


def test_no_file_or_no_sampling_fields_leave_the_apis_defaults(tmp_path) -> None:
    assert load_sampling_defaults("auto", str(tmp_path)) == SamplingDefaults()
    assert load_sampling_defaults("auto", None) == SamplingDefaults()  # a GGUF model
    folder = folder_with(tmp_path, {"bos_token_id": 1, "eos_token_id": 2, "top_k": 50})
    d = load_sampling_defaults("auto", folder)
    # transformers' own default top_k (50) is not applied, as in vLLM; 0 means none
    assert d.overridden() == {} and d.top_k == -1
    assert load_sampling_defaults("auto", folder_with(tmp_path, {"top_k": 0})).top_k == -1


@pytest.mark.parametrize(("config", "field"), [
    ({"temperature": -0.5}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"top_k": -3}, "top_k"), ({"top_k": 2.5}, "top_k"), ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"temperature": "hot"}, "temperature"), ({"temperature": True}, "temperature"),
])
def test_a_bad_value_names_the_file_and_its_field(tmp_path, config, field) -> None:
    with pytest.raises(ValueError, match=f"generation_config.json: {field}"):
        load_sampling_defaults("auto", folder_with(tmp_path, config))


def test_a_folder_without_the_file_or_a_bad_file_is_an_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="--generation-config"):
        load_sampling_defaults(str(tmp_path / "nowhere"), None)
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load_sampling_defaults("auto", str(tmp_path))


def test_a_requests_own_values_win_and_max_tokens_fits_the_context() -> None:
    d = SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.05,
                         max_tokens=64)
    sp = CompletionRequest(prompt="x").to_sampling_params(
        num_prompt_tokens=10, max_model_len=512, defaults=d)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty, sp.max_tokens) == (
        0.6, 0.9, 20, 1.05, 64)
    sp = CompletionRequest(prompt="x", temperature=0.0, top_k=-1, max_tokens=3
                           ).to_sampling_params(num_prompt_tokens=10, max_model_len=512,
                                                defaults=d)
    assert (sp.temperature, sp.top_k, sp.top_p, sp.max_tokens) == (0.0, -1, 0.9, 3)
    # the default max_tokens never asks for more than the context has room for
    sp = CompletionRequest(prompt="x").to_sampling_params(
        num_prompt_tokens=500, max_model_len=512, defaults=d)
    assert sp.max_tokens == 12
    assert CompletionRequest(prompt="x").to_sampling_params(
        num_prompt_tokens=10, max_model_len=512).temperature == 1.0


def test_the_proto_path_takes_the_defaults_for_unset_fields() -> None:
    d = SamplingDefaults(temperature=0.6, top_k=20, min_p=0.1)
    sp = sampling_params_from_proto(common_pb2.SamplingParams(), defaults=d,
                                    max_tokens_if_unset=7)
    assert (sp.temperature, sp.top_k, sp.min_p, sp.max_tokens) == (0.6, 20, 0.1, 7)
    sp = sampling_params_from_proto(common_pb2.SamplingParams(temperature=0.0, top_k=-1),
                                    defaults=d)
    assert (sp.temperature, sp.top_k, sp.min_p) == (0.0, -1, 0.1)
