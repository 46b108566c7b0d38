"""OpenAI response models besides the completions: the model list and the error JSON
(re-exported by ``protocol``, where the routes find them as ``P.ModelCard`` and so on).

Source of the shapes: the OpenAI API reference (Models, errors) and vLLM's
``entrypoints/openai/protocol.py`` for ``max_model_len``.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field

__all__ = ["ErrorInfo", "ErrorResponse", "ModelCard", "ModelList"]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tandem"
    root: str | None = None
    #: context length in tokens: the smallest the engines serving it report (vLLM's field)
    max_model_len: int | None = None
    #: the model's architecture, e.g. "LlamaForCausalLM" (from the engines; tandem's field)
    architecture: str | None = None
    #: the implementation(s) running it: "tandem" (native), "transformers", or both
    #: comma-separated when prefill and decode instances differ (tandem's field)
    model_impl: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    """The error object of OpenAI's error JSON (``errors.OpenAIError.to_dict``)."""

    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """Every non-2xx answer of the HTTP API: ``{"error": {...}}``."""

    error: ErrorInfo
