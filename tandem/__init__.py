"""tandem: disaggregated LLM serving (prefill and decode split, KV handed over a store).

The offline API is re-exported lazily so that ``import tandem`` stays cheap for
the router and CLI, which do not need torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from tandem.engine.llm import LLM
    from tandem.engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from tandem.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from tandem.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
