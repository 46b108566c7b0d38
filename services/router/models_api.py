"""OpenAI's Models API on the router: ``GET /v1/models`` (``models.list``) and
``GET /v1/models/{model}`` (``models.retrieve``), one model object per served name.

A model id may hold a slash (``HuggingFaceTB/SmolLM2-135M-Instruct``); the ``openai`` client
sends it percent-encoded (``%2F``), which the server decodes into the path, so the route
takes the rest of the path as the id.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tandem.services.router import openapi
from tandem.services.router import protocol as P
from tandem.services.router.errors import model_not_found
from tandem.services.router.frontend import Frontend


def install(app: FastAPI, fe: Frontend, check_auth: Callable[[Request], object]) -> None:
    """Add the Models API routes to ``app``.

    Args:
        fe: the served model names, context length and what the engines report.
        check_auth: raises the 401 of a request without the API key.
    """

    def card(name: str) -> P.ModelCard:
        # NOTE: what the engines report (``Discovery.facts``), not the model's files: the
        # context length a client may use and what runs the model, None until one reports.
        facts = fe.pipeline.discovery.facts
        return P.ModelCard(id=name, root=fe.served_model_names[0], max_model_len=fe.max_model_len,
                           architecture=facts.architecture or None,
                           model_impl=facts.model_impl or None)

    @app.get("/v1/models", response_model=P.ModelList,
             responses={401: openapi.GENERATION_ERRORS[401]})
    async def models(request: Request) -> JSONResponse:
        check_auth(request)
        cards = [card(name) for name in fe.served_model_names]
        return JSONResponse(P.ModelList(data=cards).model_dump(mode="json"))

    @app.get("/v1/models/{model:path}", response_model=P.ModelCard,
             responses={401: openapi.GENERATION_ERRORS[401],
                        404: {"model": P.ErrorResponse, "description": "a model not served here"}})
    async def model(request: Request, model: str) -> JSONResponse:
        check_auth(request)
        if model not in fe.served_model_names:
            raise model_not_found(model)
        return JSONResponse(card(model).model_dump(mode="json"))
