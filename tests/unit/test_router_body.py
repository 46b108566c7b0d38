"""services/router/body.py: a request body's size, encoding, JSON and Unicode checks."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.requests import Request

from tandem.services.router.body import (
    check_unicode,
    default_max_request_body_bytes,
    parse_json,
    read_body,
)
from tandem.services.router.errors import OpenAIError


def _request(chunks: list[bytes], headers: dict[str, str] | None = None) -> tuple[Request, list]:
    """A Starlette request whose body arrives in ``chunks``; also the list of chunks the
    app pulled (to see where reading stopped)."""
    pulled: list[bytes] = []
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                for i, c in enumerate(chunks)]

    async def receive() -> dict:
        msg = messages.pop(0)
        pulled.append(msg["body"])
        return msg

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [
        (k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
    return Request(scope, receive), pulled


def test_read_body_joins_chunks_up_to_the_limit() -> None:
    req, _ = _request([b"ab", b"cd", b"ef"])
    assert asyncio.run(read_body(req, 6)) == b"abcdef"


def test_read_body_stops_at_the_limit_without_content_length() -> None:
    req, pulled = _request([b"x" * 4, b"x" * 4, b"x" * 4, b"x" * 4])
    with pytest.raises(OpenAIError) as info:
        asyncio.run(read_body(req, 6))
    assert info.value.status_code == 413 and info.value.code == "request_too_large"
    assert len(pulled) == 2, "reading must stop once the limit is passed"


def test_read_body_refuses_a_declared_length_over_the_limit_before_reading() -> None:
    req, pulled = _request([b"x" * 10], {"Content-Length": "10"})
    with pytest.raises(OpenAIError) as info:
        asyncio.run(read_body(req, 9))
    assert info.value.status_code == 413
    assert pulled == []


@pytest.mark.parametrize(("value", "param"), [
    ({"prompt": "a\ud800"}, "prompt"),
    ({"messages": [{"role": "user", "content": "ok"}, {"content": "\udc00x"}]},
     "messages[1].content"),
    ({"tools": [{"function": {"parameters": {"properties": {"k\udfff": {}}}}}]},
     "tools[0].function.parameters.properties"),
    (["\ud83d"], "[0]"),
])
def test_lone_surrogate_names_its_path(value: object, param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        check_unicode(value)
    assert info.value.status_code == 400 and info.value.param == param
    assert "surrogate" in info.value.message


def test_valid_text_passes_at_any_depth() -> None:
    deep: object = "smile \U0001F600 \u00e9 \x00"
    for _ in range(50_000):  # far deeper than Python's recursion limit
        deep = [deep]
    check_unicode(deep)
    check_unicode({"a": [1, 2.5, None, True, {"b": "c"}]})


def test_parse_json_refuses_what_is_not_utf8_json() -> None:
    for body, words in ((b"", "empty"), (b"\xff", "UTF-8"),
                        ('"x"'.encode("utf-16"), "UTF-8"), (b"{x", "not valid JSON"),
                        (b"[" * 5000 + b"]" * 5000, "nested too deeply"),
                        (b'{"p": "\\ud800"}', "surrogate"),
                        (b'{"p": ["ok", "\\uDBFF"]}', "surrogate")):
        with pytest.raises(OpenAIError, match=words) as info:
            parse_json(body)
        assert info.value.status_code == 400
    assert parse_json(json.dumps({"p": "\U0001F600"}).encode()) == {"p": "\U0001F600"}


def test_default_limit_fits_a_whole_context_of_token_ids() -> None:
    max_model_len = 131072
    ids = json.dumps({"prompt": [151935] * max_model_len}).encode()
    assert len(ids) < default_max_request_body_bytes(max_model_len)
    assert default_max_request_body_bytes(1) > 8 << 20
