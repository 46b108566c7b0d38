"""What ``/openapi.json`` says about the routes whose bodies the handlers parse themselves.

The generation routes read their body through ``body.read_json_body`` (size limit, UTF-8,
Unicode checks) before pydantic validates it, so FastAPI cannot infer a request body from
their signatures. Each declares its request model here through FastAPI's public
``openapi_extra`` (a ``$ref`` into ``components.schemas``), and :func:`install` adds the
request models' JSON schemas (pydantic's, validation mode) to the generated document.
Response models and error bodies are ordinary ``response_model`` / ``responses`` entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from tandem.services.router import protocol as P

_REF = "#/components/schemas/{model}"

#: The error statuses every generation route may answer, all as OpenAI error JSON.
GENERATION_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": P.ErrorResponse, "description": "invalid request (the field in `param`)"},
    401: {"model": P.ErrorResponse, "description": "missing or wrong API key"},
    404: {"model": P.ErrorResponse, "description": "unknown `model`"},
    413: {"model": P.ErrorResponse, "description": "body over --max-request-body-bytes"},
    503: {"model": P.ErrorResponse,
          "description": "no instance can serve, or the router's queue is full (Retry-After)"},
}


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` declaring ``model`` as a route's required JSON request body."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _REF.format(model=model.__name__)}}}}}


def streamed(description: str) -> dict[int | str, dict[str, Any]]:
    """A ``responses`` entry adding the ``stream: true`` form (server-sent events) to 200."""
    return {200: {"description": description, "content": {
        "text/event-stream": {"schema": {"type": "string"}}}}}


def typed_events(description: str) -> dict[int | str, dict[str, Any]]:
    """A ``responses`` entry adding the ``stream: true`` form of an API whose server-sent
    events are named (``event: <type>`` then ``data: <JSON>``: Responses, Messages)."""
    event = {"type": "object", "properties": {"event": {"type": "string"},
                                              "data": {"type": "string"}}}
    return {200: {"description": description, "content": {
        "text/event-stream": {"schema": event}}}}


def install(app: FastAPI, request_models: Sequence[type[BaseModel]]) -> None:
    """Make ``app.openapi()`` include the JSON schemas of ``request_models`` (and the
    models they use) in ``components.schemas``, where :func:`request_body` points."""
    _, top = models_json_schema([(m, "validation") for m in request_models],
                                ref_template=_REF)
    defs = top.get("$defs", {})

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version,
                              openapi_version=app.openapi_version,
                              description=app.description, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for name, schema in defs.items():
                assert schemas.get(name, schema) == schema, (
                    f"two different schemas named {name} in /openapi.json")
                schemas[name] = schema
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented override
