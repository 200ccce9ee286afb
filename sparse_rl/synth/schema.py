"""OpenAI tool-calling schemas and a validator for the subset of JSON Schema we emit.

`jsonschema` is not a dependency of the project, and our tool schemas only ever use `type`
(object/string/integer/number/boolean/array), `properties`, `required`, `enum`, `items` and
`additionalProperties: false`, so a 60-line validator covers them exactly. Anything else in a
schema is rejected loudly (`SchemaError`) rather than silently ignored.
"""

from __future__ import annotations

from typing import Any

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}
_KNOWN = {"type", "properties", "required", "enum", "items", "additionalProperties", "description"}


class SchemaError(ValueError):
    """The schema itself uses a keyword this validator does not implement."""


def validate(value: Any, schema: dict, path: str = "$") -> list[str]:
    """Return a list of violations (empty = valid), each naming the JSON path."""
    unknown = set(schema) - _KNOWN
    if unknown:
        raise SchemaError(f"unsupported JSON Schema keyword(s) {sorted(unknown)} at {path}")
    errs: list[str] = []
    tp = schema.get("type")
    if tp is not None:
        if tp not in _TYPES:
            raise SchemaError(f"unsupported type {tp!r} at {path}")
        if not _TYPES[tp](value):
            return [f"{path}: expected {tp}, got {type(value).__name__}"]
    if "enum" in schema and value not in schema["enum"]:
        errs.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                errs.append(f"{path}: missing required property '{key}'")
        for key, sub in value.items():
            if key in props:
                errs.extend(validate(sub, props[key], f"{path}.{key}"))
            elif schema.get("additionalProperties") is False:
                errs.append(f"{path}: unexpected property '{key}'")
    if isinstance(value, list) and "items" in schema:
        for i, sub in enumerate(value):
            errs.extend(validate(sub, schema["items"], f"{path}[{i}]"))
    return errs


def tool(name: str, description: str, params: dict[str, dict], required: list[str] | None = None) -> dict:
    """An OpenAI `tools` entry: {"type":"function","function":{"name","description","parameters"}}."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": params,
                       "required": list(params) if required is None else required,
                       "additionalProperties": False}}}


def tool_index(tools: list[dict]) -> dict[str, dict]:
    """name -> parameters schema."""
    return {t["function"]["name"]: t["function"]["parameters"] for t in tools}
