"""The constraint of an OpenAI request: its HTTP fields -> one ``StructuredOutputsParams``.

A request may name its constraint in any of the ways clients send it:

* OpenAI ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``;
* vLLM's ``structured_outputs`` object: ``json``, ``json_object``, ``regex``, ``choice``,
  ``grammar``, ``disable_any_whitespace``;
* vLLM's legacy fields ``guided_json``, ``guided_regex``, ``guided_choice``,
  ``guided_grammar`` (with ``guided_whitespace_pattern`` / ``guided_decoding_backend``
  refused by name: tandem has one backend and no custom whitespace patterns);
* a tool call forced by ``tool_choice`` (``services/router/tools.py``).

Two of them in one request is a 400 naming both. Only the shape is checked here (the
router runs no grammar library: xgrammar imports torch); the engine compiles the
constraint, and its INVALID_ARGUMENT, which names ``structured_outputs.<kind>``, is
reported with the HTTP field the client used (:attr:`Constraint.param_of_field`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.engine.sampling_params import StructuredOutputsParams
from tandem.engine.validation import RequestError
from tandem.services.router.errors import OpenAIError

#: vLLM ``structured_outputs`` keys tandem takes; any other key is a 400 naming it.
_SO_KEYS = frozenset(
    {"json", "json_object", "regex", "choice", "grammar", "disable_any_whitespace"}
)
#: legacy field -> the kind it sets.
LEGACY_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


@dataclass(frozen=True)
class Constraint:
    """The request's constraint and where it came from.

    Attributes:
        params: the engine's constraint (``None``: unconstrained).
        param: the HTTP field that set it (e.g. ``"response_format.json_schema.schema"``).
        param_of_field: engine field -> HTTP field, for errors the engine reports.
    """

    params: StructuredOutputsParams | None = None
    param: str | None = None
    param_of_field: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ConstraintSource:
    """One field's constraint before the one-constraint rule is applied.

    Attributes:
        param: the HTTP field that set it (named in errors).
        kind: a ``StructuredOutputsParams`` kind.
        value: that kind's value.
    """

    param: str
    kind: str
    value: Any


def _response_format_source(rf: Any) -> ConstraintSource | None:
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise OpenAIError("response_format must be an object", param="response_format")
    kind = rf.get("type")
    unknown = set(rf) - {"type", "json_schema"}
    if unknown:
        raise OpenAIError(
            f"response_format: unsupported field {sorted(unknown)[0]!r}",
            param=f"response_format.{sorted(unknown)[0]}",
        )
    if "json_schema" in rf and kind != "json_schema":
        raise OpenAIError(
            f"response_format.json_schema goes with type json_schema, not {kind!r}",
            param="response_format.json_schema",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintSource("response_format", "json_object", True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise OpenAIError(
                "response_format.json_schema must be an object with a schema",
                param="response_format.json_schema",
            )
        unknown = set(js) - {"name", "schema", "strict", "description"}
        if unknown:
            bad = sorted(unknown)[0]
            raise OpenAIError(
                f"response_format.json_schema: unsupported field {bad!r}",
                param=f"response_format.json_schema.{bad}",
            )
        name = js.get("name")
        if name is not None and not isinstance(name, str):
            raise OpenAIError(
                "response_format.json_schema.name must be a string",
                param="response_format.json_schema.name",
            )
        if "schema" not in js:
            raise OpenAIError(
                "response_format.json_schema.schema is required",
                param="response_format.json_schema.schema",
            )
        # NOTE: `strict` true or false: the output is always held to the schema.
        if js.get("strict") is not None and not isinstance(js["strict"], bool):
            raise OpenAIError(
                "response_format.json_schema.strict must be a boolean",
                param="response_format.json_schema.strict",
            )
        return ConstraintSource("response_format.json_schema.schema", "json", js["schema"])
    raise OpenAIError(
        f"response_format.type must be one of text, json_object, json_schema, got {kind!r}",
        param="response_format.type",
    )


def _so_sources(so: Any) -> tuple[list[ConstraintSource], bool]:
    if so is None:
        return [], False
    if not isinstance(so, dict):
        raise OpenAIError("structured_outputs must be an object", param="structured_outputs")
    unknown = set(so) - _SO_KEYS
    if unknown:
        bad = sorted(unknown)[0]
        raise OpenAIError(
            f"structured_outputs.{bad} is not supported (supported: {', '.join(sorted(_SO_KEYS))})",
            param=f"structured_outputs.{bad}",
        )
    ws = so.get("disable_any_whitespace", False)
    if not isinstance(ws, bool):
        raise OpenAIError(
            "structured_outputs.disable_any_whitespace must be a boolean",
            param="structured_outputs.disable_any_whitespace",
        )
    sources = [
        ConstraintSource(f"structured_outputs.{k}", k, so[k])
        for k in ("json", "json_object", "regex", "choice", "grammar")
        if so.get(k) is not None
    ]
    return sources, ws


def build_constraint(
    *,
    response_format: Any,
    structured_outputs: Any,
    legacy: dict[str, Any],
    extra: ConstraintSource | None = None,
) -> Constraint:
    """The one constraint of a request, from all the fields that may set one.

    Args:
        response_format: OpenAI ``response_format`` (a dict) or ``None``.
        structured_outputs: vLLM's ``structured_outputs`` (a dict) or ``None``.
        legacy: ``guided_*`` field -> value, for those present.
        extra: a constraint from elsewhere (a forced tool call), or ``None``.

    Raises:
        OpenAIError: 400 naming the field: two constraints in one request (naming both),
            a malformed one (wrong type, empty choice list, a schema that is not an
            object), an unknown key.
    """
    sources: list[ConstraintSource] = []
    rf = _response_format_source(response_format)
    if rf is not None:
        sources.append(rf)
    so_sources, disable_ws = _so_sources(structured_outputs)
    sources.extend(so_sources)
    for name, value in legacy.items():
        if value is not None:
            sources.append(ConstraintSource(name, LEGACY_FIELDS[name], value))
    if extra is not None:
        sources.append(extra)
    if not sources:
        return Constraint()
    if len(sources) > 1:
        a, b = sources[0].param, sources[1].param
        raise OpenAIError(f"{a} and {b} both constrain the output; set only one", param=a)
    src = sources[0]
    value = src.value
    if src.kind == "choice" and isinstance(value, list):
        value = tuple(value)
    try:
        params = StructuredOutputsParams(**{src.kind: value}, disable_any_whitespace=disable_ws)
    except RequestError as exc:
        message = str(exc).replace(exc.field, src.param, 1)
        raise OpenAIError(message, param=src.param) from exc
    return Constraint(params, src.param, {params.field: src.param})


def check_unsupported(extra_fields: dict[str, Any] | None) -> None:
    """Refuse, by name, the vLLM guided-decoding knobs tandem does not implement.

    Raises:
        OpenAIError: 400 for ``guided_whitespace_pattern``, or a
            ``guided_decoding_backend`` other than ``xgrammar`` / ``auto``.
    """
    fields = extra_fields or {}
    if fields.get("guided_whitespace_pattern") is not None:
        raise OpenAIError(
            "guided_whitespace_pattern is not supported (use "
            "structured_outputs.disable_any_whitespace)",
            param="guided_whitespace_pattern",
        )
    backend = fields.get("guided_decoding_backend")
    if backend is not None and backend not in ("xgrammar", "auto"):
        raise OpenAIError(
            f"guided_decoding_backend {backend!r} is not available: tandem uses xgrammar",
            param="guided_decoding_backend",
        )
