"""The rules a JSON schema of a constraint must pass before it is compiled.

Torch-free (the router applies them too): a schema must be an object that is a valid
JSON schema (its metaschema, by ``jsonschema``), and must use no keyword the grammar
backend would compile without enforcing.
"""

from __future__ import annotations

from typing import Any

from tandem.engine.validation import RequestError

#: JSON-schema keywords xgrammar compiles without enforcing (found by matching outputs that
#: break them): a schema using one is refused, so no output claims a constraint it lacks.
UNSUPPORTED_SCHEMA_KEYWORDS = ("not", "if", "then", "else")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = (
    "items",
    "additionalProperties",
    "contains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
)
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def unsupported_schema_feature(schema: object, path: str = "#") -> str | None:
    """Where ``schema`` uses a keyword xgrammar would not enforce, as ``"<keyword> at
    <JSON pointer>"``; ``None`` when it uses none. Also ``allOf`` with several branches,
    which xgrammar only partly merges, and a ``$ref`` that is not local (``#...``), which
    it leaves unconstrained."""
    if not isinstance(schema, dict):
        return None
    for key in UNSUPPORTED_SCHEMA_KEYWORDS:
        if key in schema:
            return f"'{key}' at {path}"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f"'$ref' to {ref!r} (only references within the schema, '#/...') at {path}"
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        return f"'allOf' with {len(all_of)} branches at {path}"
    for key in _SUBSCHEMA_MAPS:
        sub = schema.get(key)
        if isinstance(sub, dict):
            for name, value in sub.items():
                found = unsupported_schema_feature(value, f"{path}/{key}/{name}")
                if found:
                    return found
    for key in _SUBSCHEMAS:
        found = unsupported_schema_feature(schema.get(key), f"{path}/{key}")
        if found:
            return found
    for key in _SUBSCHEMA_LISTS:
        sub = schema.get(key)
        if isinstance(sub, list):
            for i, value in enumerate(sub):
                found = unsupported_schema_feature(value, f"{path}/{key}/{i}")
                if found:
                    return found
    return None



def check_json_schema(schema: Any, field: str, *, enforced: bool = True) -> None:
    """Refuse a schema that is not a JSON-schema object, breaks its metaschema (the
    dialect its ``$schema`` names, else draft 2020-12), or, when it is ``enforced`` (it
    becomes a grammar), uses a keyword xgrammar does not enforce
    (``unsupported_schema_feature``). Pointers in messages are relative to ``schema``.

    Raises:
        RequestError: naming ``field``, with jsonschema's message for a metaschema error.
    """
    # Imported here: the offline engine imports this module with SamplingParams, and an
    # image without jsonschema (the GPU check's) still runs requests that carry no schema;
    # one that does fails here, naming the missing package.
    import jsonschema

    if not isinstance(schema, dict):
        raise RequestError(field, f"{field} must be a JSON schema object")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except RecursionError:
        raise RequestError(field, f"{field} is nested too deeply") from None
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        at = f" at #/{where}" if where else ""
        raise RequestError(
            field, f"{field} is not a valid JSON schema{at}: {exc.message}"
        ) from None
    try:
        found = unsupported_schema_feature(schema) if enforced else None
    except RecursionError:
        raise RequestError(field, f"{field} is nested too deeply") from None
    if found is not None:
        raise RequestError(
            field,
            f"{field}: the JSON schema uses {found}, which the grammar backend (xgrammar) "
            "cannot enforce",
        )
