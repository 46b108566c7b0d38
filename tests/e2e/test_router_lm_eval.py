"""lm-evaluation-harness's ``local-completions`` model against a real router (issue 40).

``lm_eval.simple_evaluate`` runs two local tasks (tests/e2e/lm_eval_task/: YAML + JSONL,
nothing fetched from the Hub) through the router over a tiny float32 engine, lm-eval
tokenizing with the tiny model folder's own tokenizer and sending token ids:

* ``tandem_tiny_mc`` (``multiple_choice``, loglikelihood requests: ``echo``, ``logprobs``,
  ``max_tokens: 1``, lm-eval slices the prompt's ``token_logprobs``): every choice's
  loglikelihood equals transformers' float32 sum of log-softmax of the continuation tokens
  given the context within 1e-3, its ``is_greedy`` the argmax check, and ``acc`` the
  accuracy of transformers' picks.
* ``tandem_tiny_gen`` (``generate_until``, stop ``"\\n"``): every answer is the router's
  own greedy text up to the first newline, and ``exact_match`` agrees with them.

``local-chat-completions`` (generation only in lm-eval) runs ``tandem_tiny_gen`` through
``/v1/chat/completions`` with ``apply_chat_template``: the router's greedy chat answers.
"""

from __future__ import annotations

import sys
from pathlib import Path

import openai
import pytest
import torch
import yaml
from ports import free_port

from tandem.launch import Launcher, Part, grpc_serving, http_ok, tandem_argv

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from services_harness import tiny_model_dir  # noqa: E402

TASK_DIR = Path(__file__).resolve().parent / "lm_eval_task"
MAX_MODEL_LEN = 256
TOL = 1e-3
MAX_GEN_TOKS = 12  # tandem_tiny_gen.yaml's max_gen_toks


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(tiny_model_dir(tmp_path_factory.getbasetemp()))


@pytest.fixture(scope="module")
def router(tiny, tmp_path_factory):
    """The router's base URL (``.../v1``), colocated over one float32 engine."""
    launcher = Launcher(tmp_path_factory.mktemp("lm_eval"))
    try:
        eng_port, port = free_port(), free_port()
        launcher.launch([Part("engine", tandem_argv(
            "serve", "--role", "both", "--listen", f"127.0.0.1:{eng_port}", "--model", tiny,
            "--dtype", "float32", "--num-kv-blocks", "256", "--block-size", "16",
            "--max-model-len", str(MAX_MODEL_LEN)),
            lambda: grpc_serving(f"127.0.0.1:{eng_port}"))], 300)
        launcher.launch([Part("router", tandem_argv(
            "router", "--host", "127.0.0.1", "--port", str(port), "--grpc-port", "0",
            "--model", tiny, "--max-model-len", str(MAX_MODEL_LEN),
            "--colocated", f"127.0.0.1:{eng_port}"),
            lambda: http_ok(f"http://127.0.0.1:{port}/ready"))], 300)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        launcher.close(timeout_s=30)


def task_config(name: str, cache_dir: Path) -> dict:
    """The task's YAML, its data file resolved against TASK_DIR and its cache under
    ``cache_dir`` (HF datasets resolves relative data files against the working directory)."""
    config = yaml.safe_load((TASK_DIR / f"{name}.yaml").read_text())
    kwargs = config["dataset_kwargs"]
    kwargs["data_files"] = {k: str(TASK_DIR / v) for k, v in kwargs["data_files"].items()}
    kwargs["cache_dir"] = str(cache_dir)
    return config


def offline(monkeypatch, tmp_path: Path) -> None:
    """No Hub access from lm-eval, datasets or transformers (the flags are read at import,
    so the already-imported modules' copies are set too)."""
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)


def continuation_scores(hf, tok, context: str, continuation: str) -> tuple[float, bool]:
    """transformers' float32 loglikelihood of ``continuation`` after ``context`` and
    whether every continuation token is the argmax, on lm-eval's token split (the whole
    text encoded, the context's tokens cut off; no special tokens)."""
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    assert whole[: len(ctx)] == ctx and len(whole) > len(ctx)
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([whole])).logits[0].float()
    lps = torch.log_softmax(logits, dim=-1)[len(ctx) - 1: -1]
    cont = torch.tensor(whole[len(ctx):])
    own = lps.gather(1, cont[:, None])[:, 0]
    return float(own.sum()), bool((lps.argmax(dim=-1) == cont).all())


def test_lm_eval_local_completions(router, tiny, tmp_path, monkeypatch) -> None:
    offline(monkeypatch, tmp_path)
    import lm_eval
    from transformers import AutoModelForCausalLM, AutoTokenizer

    client = openai.OpenAI(base_url=router, api_key="none", timeout=120.0, max_retries=0)
    model = client.models.list().data[0].id
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": model, "base_url": f"{router}/completions",
                    "tokenizer_backend": "huggingface", "tokenizer": tiny,
                    "num_concurrent": 1, "max_retries": 1, "max_length": MAX_MODEL_LEN},
        tasks=[task_config(n, tmp_path / "datasets") for n in ("tandem_tiny_mc",
                                                                "tandem_tiny_gen")],
        log_samples=True, batch_size=1, cache_requests=False)
    assert out is not None
    samples, results = out["samples"], out["results"]

    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny)

    mc = sorted(samples["tandem_tiny_mc"], key=lambda s: s["doc_id"])
    assert len(mc) == 5
    hits = []
    for s in mc:
        doc = s["doc"]
        got = [tuple(r) for r in s["filtered_resps"]]
        want = [continuation_scores(hf, tok, doc["question"], " " + c) for c in doc["choices"]]
        for (ll, greedy), (ref_ll, ref_greedy) in zip(got, want, strict=True):
            assert abs(ll - ref_ll) < TOL, (doc, got, want)
            assert greedy == ref_greedy, (doc, got, want)
        pick = max(range(len(want)), key=lambda i: want[i][0])
        assert max(range(len(got)), key=lambda i: got[i][0]) == pick
        hits.append(pick == doc["label"])
        assert s["acc"] == float(hits[-1])
    assert results["tandem_tiny_mc"]["acc,none"] == pytest.approx(sum(hits) / len(hits))

    gen = sorted(samples["tandem_tiny_gen"], key=lambda s: s["doc_id"])
    assert len(gen) == 4
    matches = []
    for s in gen:
        doc = s["doc"]
        ids = tok(doc["prompt"], add_special_tokens=False).input_ids
        resp = client.completions.create(model=model, prompt=ids, max_tokens=MAX_GEN_TOKS,
                                         temperature=0)
        text = resp.choices[0].text.split("\n")[0]
        (answer,) = s["filtered_resps"]
        assert answer == text, (doc, answer, text)
        matches.append(answer.strip() == doc["answer"])
    assert results["tandem_tiny_gen"]["exact_match,none"] == pytest.approx(
        sum(matches) / len(matches))


def test_lm_eval_local_chat_completions(router, tiny, tmp_path, monkeypatch) -> None:
    offline(monkeypatch, tmp_path)
    import lm_eval

    client = openai.OpenAI(base_url=router, api_key="none", timeout=120.0, max_retries=0)
    model = client.models.list().data[0].id
    out = lm_eval.simple_evaluate(
        model="local-chat-completions",
        model_args={"model": model, "base_url": f"{router}/chat/completions",
                    "num_concurrent": 1, "max_retries": 1},
        tasks=[task_config("tandem_tiny_gen", tmp_path / "datasets")],
        apply_chat_template=True, log_samples=True, batch_size=1, cache_requests=False)
    assert out is not None
    gen = sorted(out["samples"]["tandem_tiny_gen"], key=lambda s: s["doc_id"])
    assert len(gen) == 4
    for s in gen:
        resp = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": s["doc"]["prompt"]}],
            max_tokens=MAX_GEN_TOKS, temperature=0)
        content = resp.choices[0].message.content
        assert content is not None
        (answer,) = s["filtered_resps"]
        assert answer == content.split("\n")[0], (s["doc"], answer, content)
