"""A row's `response_format`, shaped as in the OpenAI API, normalised to one canonical spec.

    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}   -> {"json": schema}
    {"type": "json_object"}                                                   -> {"json_object": true}
    {"type": "regex", "regex": "..."}        (as vLLM's structured outputs)   -> {"regex": "..."}
    {"type": "choice", "choice": ["a", "b"]}                                  -> {"choice": [...]}
    {"type": "text"} or nothing                                               -> None

The spec travels as a canonical JSON string in SamplingParams.structured, so requests stay hashable
and equal specs share one compiled grammar. Each engine turns it into its own constraint.
"""

from __future__ import annotations

import json
from typing import Any


def normalise_response_format(value: Any) -> str | None:
    """A row's response_format (a dict, or a JSON string) -> canonical spec JSON, or None; raises ValueError."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"response_format is not valid JSON ({e.msg})") from None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ValueError("response_format must be an object with a 'type'")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        spec: dict[str, Any] = {"json_object": True}
    elif kind == "json_schema":
        inner = value.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"response_format.json_schema.schema is not valid JSON ({e.msg})") from None
        if not isinstance(schema, dict):
            raise ValueError("response_format of type json_schema needs json_schema.schema, an object")
        spec = {"json": schema}
    elif kind == "regex":
        if not isinstance(value.get("regex"), str) or not value["regex"]:
            raise ValueError("response_format of type regex needs a non-empty 'regex'")
        spec = {"regex": value["regex"]}
    elif kind == "choice":
        choice = value.get("choice")
        if not isinstance(choice, list) or not choice or not all(isinstance(c, str) and c for c in choice):
            raise ValueError("response_format of type choice needs 'choice', a list of non-empty strings")
        spec = {"choice": choice}
    else:
        raise ValueError(f"response_format type {kind!r} is not one of text, json_object, json_schema, regex, choice")
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))
