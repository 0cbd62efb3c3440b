"""OpenAI's `response_format`, parsed: plain text, one JSON object, or JSON that follows a schema. A schema is
compiled here, so that one this worker cannot follow is refused before it runs (`unsupported_parameter`: the
gateway hands such a request to a provider that follows it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from backends.server.errors import invalid_param, unsupported_param
from backends.structured_output.json_output import compiled_schema
from backends.structured_output.json_schema import UnsupportedSchema


@dataclass(frozen=True, slots=True)
class OutputFormat:
    json_object: bool = False           # any one JSON object
    json_schema: str | None = None      # the schema as JSON text, in its own key order (properties come in it)

    @property
    def structured(self) -> bool:
        return self.json_object or self.json_schema is not None


def parse_response_format(body: dict[str, Any]) -> OutputFormat:
    value = body.get("response_format")
    if value is None:
        return OutputFormat()
    if not isinstance(value, dict):
        raise invalid_param("response_format", "`response_format` must be an object.")
    kind = value.get("type")
    if kind == "text":
        return OutputFormat()
    if kind == "json_object":
        return OutputFormat(json_object=True)
    if kind != "json_schema":
        raise invalid_param("response_format", "`response_format.type` must be 'text', 'json_object' or 'json_schema'.")
    spec = value.get("json_schema")
    schema = spec.get("schema", {}) if isinstance(spec, dict) else None
    if not isinstance(schema, (dict, bool)):
        raise invalid_param("response_format.json_schema",
                            "`response_format.json_schema` must be an object whose `schema` is a JSON schema.")
    text = orjson.dumps(schema).decode()
    try:
        compiled_schema(text)
    except UnsupportedSchema as exc:
        raise unsupported_param("response_format", f"This worker cannot follow this JSON schema: {exc}") from None
    return OutputFormat(json_schema=text)
