"""Reading one request body at the HTTP edge: bounded size, UTF-8, JSON, valid Unicode.

Every generation route reads its body through :func:`read_json_body`, so these rules hold
in one place, before pydantic sees the value:

* at most ``max_bytes`` bytes (413, checked from ``Content-Length`` before reading and
  again while reading, so a chunked upload is cut off at the limit, not buffered whole);
* UTF-8 as RFC 8259 requires (``json.loads`` on bytes would also take UTF-16/32);
* JSON no deeper than Python's decoder recurses (~1,000 levels) -- deeper is a 400;
* no lone UTF-16 surrogate (``"\\ud800"``: valid JSON, but no Unicode text) in any string
  or object key: a 400 naming the field's path as the router's other errors do
  (``messages[0].content``, ``errors.field_path``), instead of a ``UnicodeEncodeError`` deep in the tokenizer or a log call.
"""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.requests import Request

from tandem.services.router.errors import OpenAIError, field_path

#: A lone surrogate: what ``json.loads`` makes of an unpaired ``\\udXXX`` escape (a paired
#: escape becomes one astral character, never a surrogate).
_SURROGATE = re.compile("[\ud800-\udfff]")
#: The only way a surrogate gets into decoded JSON: strict UTF-8 decoding refuses encoded
#: ones, so a body without such an escape needs no walk over its values.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


#: The context length (tokens) the default body limit is sized for when the router has no
#: --max-model-len: it starts before any engine reports its own, so it assumes a 128K
#: context (a larger one needs --max-model-len or --max-request-body-bytes).
UNKNOWN_CONTEXT_TOKENS = 128 * 1024


def default_max_request_body_bytes(max_model_len: int) -> int:
    """The default body limit for a context of ``max_model_len`` tokens: 8 MiB plus 32
    bytes per token, room for a whole-context prompt as token ids (``"151935, "``: up to
    ~8 bytes each) or as text with every character written as a ``\\uXXXX`` escape."""
    return (8 << 20) + 32 * max_model_len


def _too_large(max_bytes: int) -> OpenAIError:
    return OpenAIError(f"request body exceeds the router's limit of {max_bytes} bytes "
                       "(--max-request-body-bytes)", status_code=413,
                       code="request_too_large")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, at most ``max_bytes`` bytes.

    Raises:
        OpenAIError: 413 ``request_too_large`` when ``Content-Length`` or the bytes
            received exceed ``max_bytes`` (reading stops there).
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(body: bytes) -> Any:
    """Decode a JSON body (UTF-8) and check that its text is valid Unicode.

    Raises:
        OpenAIError: 400 for an empty body, bytes that are not UTF-8, malformed JSON,
            nesting too deep for the decoder, or a lone surrogate (``param``: its path).
    """
    if not body:
        raise OpenAIError("request body is empty; expected a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise OpenAIError(f"request body is not valid UTF-8: {exc.reason} at byte "
                          f"{exc.start}") from exc
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise OpenAIError(f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        # json's decoder recurses once per nesting level (~1,000 deep is Python's limit)
        raise OpenAIError("request body is not valid JSON: nested too deeply") from exc
    if _SURROGATE_ESCAPE.search(text):
        check_unicode(value)
    return value


#: A value's place in the body: (the parent's path, its key or index), ``None`` at the root.
_Path = tuple[Any, str | int] | None


def check_unicode(value: Any) -> None:
    """Raise unless every string and key in the decoded JSON ``value`` is valid Unicode.

    Iterative, so it walks any depth ``json.loads`` produced without recursing; linear in
    the size of ``value`` (a path is only spelled out for the error).

    Raises:
        OpenAIError: 400 naming the path of a string (or object key) that holds a lone
            UTF-16 surrogate, as ``errors.field_path`` writes it (``messages[0].content``).
    """
    stack: list[tuple[Any, _Path]] = [(value, None)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            _check_text(item, path, "")
        elif isinstance(item, dict):
            for key, sub in item.items():
                _check_text(key, path, "an object key ")
                stack.append((sub, (path, key)))
        elif isinstance(item, list):
            # (numbers, the bulk of a token-id prompt, hold no text: not stacked)
            stack.extend((sub, (path, i)) for i, sub in enumerate(item)
                         if isinstance(sub, (str, dict, list)))


def _check_text(text: str, path: _Path, what: str) -> None:
    match = _SURROGATE.search(text)
    if match is None:
        return
    keys: list[str | int] = []
    while path is not None:
        path, key = path
        keys.append(key)
    param = field_path(reversed(keys))
    where = f"{param}: " if param else ""
    raise OpenAIError(f"{where}{what}holds a lone UTF-16 surrogate "
                      f"(\\u{ord(match.group()):04x} at character {match.start()}); strings "
                      "must be valid Unicode", param=param)


async def read_json_body(request: Request, max_bytes: int) -> Any:
    """:func:`read_body` then :func:`parse_json`. Raises: ``OpenAIError`` (413, 400)."""
    return parse_json(await read_body(request, max_bytes))
