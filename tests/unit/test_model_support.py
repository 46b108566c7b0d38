"""docs/models.md is generated from the registry and the suite's verified list
(engine/models/support.py): the page and the code cannot drift apart."""

from __future__ import annotations

from pathlib import Path

from tandem.engine.models.registry import MODEL_REGISTRY
from tandem.engine.models.support import (
    TRANSFORMERS_TP_VERIFIED,
    TRANSFORMERS_VERIFIED,
    render_markdown,
    support_table,
)

ROOT = Path(__file__).resolve().parents[2]


def test_docs_models_page_is_the_generated_table() -> None:
    page = (ROOT / "docs" / "models.md").read_text()
    assert page == render_markdown(), (
        "docs/models.md is stale: python -P -m tandem.engine.models.support > docs/models.md")


def test_every_native_architecture_has_a_row_that_auto_picks() -> None:
    rows = {(r.architecture, r.model_impl): r for r in support_table()}
    for arch in MODEL_REGISTRY:
        assert rows[(arch, "tandem")].default
        if (arch, "transformers") in rows:
            assert not rows[(arch, "transformers")].default
    for arch in TRANSFORMERS_VERIFIED:
        row = rows[(arch, "transformers")]
        assert not (row.pipeline_parallel or row.expert_parallel)
        assert row.tensor_parallel == (arch in TRANSFORMERS_TP_VERIFIED)


def test_transformers_tp_rows_have_a_servable_plan() -> None:
    """A Transformers-backend row marked TP=yes is one the backend does not refuse at
    TP=2: its default config's plan splits by colwise / rowwise only."""
    import transformers

    from tandem.engine.models.transformers_tp import check_tp_plan

    assert set(TRANSFORMERS_TP_VERIFIED) <= set(TRANSFORMERS_VERIFIED)
    for arch in TRANSFORMERS_TP_VERIFIED:
        config = getattr(transformers, arch.replace("ForCausalLM", "Config"))()
        check_tp_plan(config, arch, 2)
