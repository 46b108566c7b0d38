"""The router's one error type and its one FastAPI exception handler (OpenAI error JSON).

Every failure the HTTP layer reports goes through :func:`openai_error_handler`, which
renders ``{"error": {"message", "type", "param", "code"}}`` as the OpenAI API does (and,
under ``/v1/messages``, Anthropic's ``{"type": "error", "error": {"type", "message"}}``):
caller mistakes are 4xx (pydantic validation errors and malformed JSON become 400, never
422 or 500), a full queue is 503 with ``Retry-After``, and only a bug in the router is 500.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.engine.validation import ContextLengthError, RequestError

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


#: Anthropic's error types (its API reference, "Errors"), by HTTP status.
_ANTHROPIC_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
#: The path prefix of the Anthropic Messages API, whose errors take Anthropic's shape.
ANTHROPIC_PATH_PREFIX = "/v1/messages"


class OpenAIError(Exception):
    """An error reported to the client as OpenAI error JSON.

    NOTE: deliberately not a ``ValueError``: pydantic would wrap a ``ValueError`` raised
    in a validator into its own ``ValidationError`` and lose ``param`` and ``code``.

    Attributes:
        message: human-readable text.
        status_code: HTTP status (400 unless given).
        param: the offending request field, if any.
        code: machine-readable code, e.g. ``context_length_exceeded``.
        retry_after_s: seconds for the ``Retry-After`` header (503 only).
    """

    def __init__(
        self,
        message: str,
        *,
        status_code: int = 400,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    @property
    def type(self) -> str:
        return _TYPE_BY_STATUS.get(self.status_code, "server_error" if self.status_code >= 500
                                   else "invalid_request_error")

    def to_dict(self) -> dict:
        """The error object (``{"message", "type", "param", "code"}``), without the wrapper."""
        return {"message": self.message, "type": self.type, "param": self.param,
                "code": self.code if self.code is not None else self.status_code}

    def to_anthropic(self) -> dict:
        """Anthropic's error body: ``{"type": "error", "error": {"type", "message"}}``
        (the field in error is named in the message, as Anthropic's API does)."""
        kind = _ANTHROPIC_TYPE_BY_STATUS.get(
            self.status_code, "api_error" if self.status_code >= 500 else "invalid_request_error")
        message = self.message
        if self.param and self.param not in message:
            message = f"{self.param}: {message}"
        return {"type": "error", "error": {"type": kind, "message": message}}


# pydantic names the member of a union a value failed to match in the error's location
# (``("guided_json", "dict[str,any]")``): type names, not fields of the request.
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "none"})


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and (part in _UNION_TAGS or "[" in part)


def field_path(parts: Iterable[object]) -> str | None:
    """A field's path as the router's errors write it: ``messages[1].content`` (list
    indices in brackets), from pydantic's location tuple; ``None`` for the empty path."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or None


def from_validation_error(exc: ValidationError | RequestValidationError) -> OpenAIError:
    """A 400 naming the first invalid field of a pydantic validation error."""
    errors = exc.errors()
    if not errors:
        return OpenAIError("invalid request")
    first = errors[0]
    param = field_path(p for p in first.get("loc", ()) if p != "body" and not _is_union_tag(p))
    msg = first.get("msg", "invalid value")
    members = _union_members(errors, first)
    if len(members) > 1:
        # The first member's complaint alone misleads (``prompt: [false]`` is no list of
        # token ids, not "no valid string"): name every form the field takes.
        msg = f"Input should be one of: {', '.join(members)}"
    return OpenAIError(f"{param}: {msg}" if param else msg, param=param)


def _union_members(errors: Sequence[Any], first: Mapping[str, Any]) -> list[str]:
    """The union members pydantic tried for the field of ``first`` (``[]``: no union)."""
    loc = tuple(first.get("loc", ()))
    cut = next((i for i, p in enumerate(loc) if _is_union_tag(p)), None)
    if cut is None:
        return []
    members: list[str] = []
    for err in errors:
        other = tuple(err.get("loc", ()))
        if other[:cut] == loc[:cut] and len(other) > cut and _is_union_tag(other[cut]):
            if other[cut] not in members:
                members.append(str(other[cut]))
    return members


def from_request_error(exc: RequestError) -> OpenAIError:
    """A 400 naming ``exc.field`` as ``param``, for a request that breaks an engine rule
    (``engine.validation``); ``context_length_exceeded`` in OpenAI's words for a prompt
    (plus ``max_tokens``) beyond the context length."""
    if isinstance(exc, ContextLengthError):
        completion = exc.max_tokens or 1
        return OpenAIError(
            f"This model's maximum context length is {exc.max_model_len} tokens. However, you "
            f"requested {exc.num_prompt_tokens + completion} tokens ({exc.num_prompt_tokens} "
            f"in the messages, {completion} in the completion). Please reduce the length of "
            "the messages or completion.",
            param=exc.field, code="context_length_exceeded")
    return OpenAIError(str(exc), param=exc.field)


def model_not_found(model: str) -> OpenAIError:
    """The 404 ``model_not_found`` of a model this router does not serve (OpenAI's words)."""
    return OpenAIError(f"The model `{model}` does not exist.", status_code=404, param="model",
                       code="model_not_found")


def unknown_route(request: Request, exc: StarletteHTTPException) -> OpenAIError | None:
    """The error of a request no route serves, naming its method and path as OpenAI's
    "Invalid URL (POST /v1/...)" does: a 404 that lists the API tandem serves, or a 405
    that names the methods the path takes. ``None`` for any other HTTP error."""
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        return OpenAIError(f"Method not allowed ({where}): this route takes {allowed}",
                           status_code=405)
    if exc.status_code != 404 or request.scope.get("endpoint") is not None:
        return None  # a route's own 404
    served = sorted(f"{method} {route.path_format}" for route in request.app.routes
                    if isinstance(route, APIRoute) and route.path_format.startswith("/v1/")
                    for method in (route.methods or ()))
    return OpenAIError(f"Invalid URL ({where}): tandem does not serve this route; its API is "
                       f"{', '.join(served)}", status_code=404)


def to_openai_error(exc: Exception) -> OpenAIError:
    """Map any exception the HTTP layer sees to an ``OpenAIError``."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, RequestError):
        return from_request_error(exc)
    if isinstance(exc, (ValidationError, RequestValidationError)):
        return from_validation_error(exc)
    if isinstance(exc, json.JSONDecodeError):
        return OpenAIError(f"request body is not valid JSON: {exc.msg}")
    if isinstance(exc, StarletteHTTPException):
        phrase = HTTPStatus(exc.status_code).phrase if exc.status_code in HTTPStatus._value2member_map_ else ""
        return OpenAIError(str(exc.detail or phrase), status_code=exc.status_code)
    logger.exception("internal error", exc_info=exc)
    return OpenAIError(f"internal error: {type(exc).__name__}", status_code=500)


def error_response(err: OpenAIError, request_id: str | None = None, *,
                   anthropic: bool = False) -> JSONResponse:
    """The HTTP answer of ``err``: OpenAI's error JSON, or Anthropic's (``anthropic``),
    with ``Retry-After`` and ``X-Request-Id`` headers where they apply."""
    headers = {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(err.retry_after_s)
    if request_id:
        headers["X-Request-Id"] = request_id
    body = err.to_anthropic() if anthropic else {"error": err.to_dict()}
    return JSONResponse(body, status_code=err.status_code, headers=headers)


async def openai_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """The one exception handler: any exception -> OpenAI error JSON with its status
    (Anthropic's error JSON under ``ANTHROPIC_PATH_PREFIX``)."""
    err = unknown_route(request, exc) if isinstance(exc, StarletteHTTPException) else None
    response = error_response(err or to_openai_error(exc), request.headers.get("x-request-id"),
                              anthropic=request.url.path.startswith(ANTHROPIC_PATH_PREFIX))
    if isinstance(exc, StarletteHTTPException) and exc.headers:
        response.headers.update(exc.headers)  # e.g. a 405's Allow
    return response


def rename_field(param: str, rules: Sequence[tuple[re.Pattern[str], str]]) -> str:
    """``param`` (a chat request's field path, as an error names it) in another API's
    words: the first of ``rules`` (pattern, replacement) that matches rewrites it once;
    no match leaves it as it is."""
    for pattern, repl in rules:
        new, n = pattern.subn(repl, param, count=1)
        if n:
            return new
    return param
