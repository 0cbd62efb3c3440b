"""Tool use on the worker, parsed: `tools`, `tool_choice` and `parallel_tool_calls` of a chat request.

A call the client forces (`tool_choice: "required"`, or one that names a function) is answered by decoding
under a JSON schema built from the tools' `parameters` (backends/structured_output/json_schema.py), so every call is
well formed and its arguments follow their schema, whatever the model: the arguments of the named function,
or an array of `{"name": ..., "arguments": ...}` for "required". `tool_choice: "none"` renders the tools
into the prompt (where the chat template writes them) and answers text. `"auto"`, the default with tools,
needs a parser for the model's own tool-call syntax, which this worker does not have: it is refused with
`unsupported_parameter` (the gateway hands such a request to a provider that parses them), as are legacy
`functions` and tools other than functions. Pure: no I/O, no engine.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

import orjson

from backends.server.errors import APIError, invalid_param, unsupported_param
from backends.server.fields import opt_bool
from backends.structured_output.json_output import compiled_schema
from backends.structured_output.json_schema import UnsupportedSchema

MAX_TOOLS = 128                                   # OpenAI's limit
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")        # OpenAI's function names
_SHAPING = frozenset({"properties", "additionalProperties", "unevaluatedProperties", "$ref", "anyOf", "oneOf",
                      "allOf", "enum", "const"})   # keywords that say what the object holds


@dataclass(frozen=True, slots=True)
class ToolCalling:
    """The request's tools and what it forces. `schema` constrains the answer (None: "none", text)."""
    tools: tuple[dict[str, Any], ...]   # as the chat template takes them: {"type": "function", "function": ...}
    forced: str | None                  # the function tool_choice names; None with a schema: "required"
    schema: str | None                  # the answer's JSON schema, as JSON text

    @property
    def calls(self) -> bool:
        """The answer is tool calls (not text)."""
        return self.schema is not None


def parse_tools(body: dict[str, Any]) -> ToolCalling | None:
    """The request's tool use; None when it has no tools. Raises APIError for what is malformed (400) or what
    this worker cannot honour (`unsupported_parameter`)."""
    if body.get("functions") is not None or body.get("function_call") is not None:
        name = "functions" if body.get("functions") is not None else "function_call"
        raise unsupported_param(name, "The legacy `functions` and `function_call` are not supported: use `tools`.")
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = opt_bool(body, "parallel_tool_calls")
    if tools is None or tools == []:
        if choice is not None and choice != "none" and choice != "auto":
            raise invalid_param("tool_choice", "`tool_choice` other than 'none' or 'auto' needs `tools`.")
        return None
    functions = _parse_tool_list(tools)
    if choice is None or choice == "auto":
        raise unsupported_param("tool_choice", "This worker answers tool calls when `tool_choice` is 'required' "
                                "or names a function; 'auto' (the default with tools) needs a parser for the "
                                "model's own tool-call syntax, which it does not have.")
    rendered = tuple({"type": "function", "function": f} for f in functions)
    if choice == "none":
        return ToolCalling(rendered, None, None)
    by_name = {f["name"]: f for f in functions}
    if choice == "required":
        alternatives = [_call_schema(f, i) for i, f in enumerate(functions)]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}}
        if parallel is False:
            schema["maxItems"] = 1
        return ToolCalling(rendered, None, _compiled(schema))
    name = _named_choice(choice)
    if name not in by_name:
        raise invalid_param("tool_choice", f"`tool_choice` names {name!r}, which is not among `tools`.")
    return ToolCalling(rendered, name, _compiled(_arguments_schema(by_name[name])))


def _parse_tool_list(tools: Any) -> list[dict[str, Any]]:
    """Each tool's function: name, description, parameters (an object schema), as the client wrote them."""
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise invalid_param("tools", f"`tools` must be an array of at most {MAX_TOOLS} tools.")
    functions, names = [], set()
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid_param(param, f"`{param}` must be an object.")
        if tool.get("type") != "function":
            raise unsupported_param(param, f"`{param}`: only tools of type 'function' are supported.")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise invalid_param(f"{param}.function", f"`{param}.function` must be an object.")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise invalid_param(f"{param}.function.name", "A function name must be 1 to 64 letters, digits, "
                                "underscores or dashes.")
        if name in names:
            raise invalid_param(f"{param}.function.name", f"Two tools are named {name!r}.")
        names.add(name)
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise invalid_param(f"{param}.function.parameters", "`parameters` must be a JSON schema of an object.")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise invalid_param(f"{param}.function.description", "`description` must be a string.")
        functions.append(function)
    return functions


def _named_choice(choice: Any) -> str:
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise invalid_param("tool_choice", "`tool_choice` must be 'none', 'auto', 'required' or "
                            "{\"type\": \"function\", \"function\": {\"name\": ...}}.")
    return name


def _arguments_schema(function: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters as the schema of its arguments; parameters that say nothing of what the object
    holds (an empty schema would let any JSON value through) take an empty object."""
    parameters: dict[str, Any] = function.get("parameters", {})
    if _SHAPING.intersection(parameters):
        return parameters
    return {**parameters, "type": "object", "additionalProperties": False}


def _call_schema(function: dict[str, Any], index: int) -> dict[str, Any]:
    """One call of the array "required" answers with: its name, then its arguments. References inside the
    parameters point into them from here on."""
    where = f"#/items/anyOf/{index}/properties/arguments"
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             "arguments": _rebased(_arguments_schema(function), where)},
            "required": ["name", "arguments"]}


def _rebased(schema: Any, where: str) -> Any:
    """`schema` with each local `$ref` ("#...") moved under the JSON pointer `where`."""
    schema = copy.deepcopy(schema)
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                node["$ref"] = where + ref[1:]
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return schema


def _compiled(schema: dict[str, Any]) -> str:
    try:
        text = orjson.dumps(schema).decode()
        compiled_schema(text)
    except UnsupportedSchema as exc:
        raise unsupported_param("tools", f"This worker cannot follow these tools' parameters: {exc}") from None
    except (RecursionError, orjson.JSONEncodeError):
        raise invalid_param("tools", "The tools' parameters nest too deeply.") from None
    return text


def refuse_with_structured_output(tools: ToolCalling | None, structured: bool) -> None:
    if tools is not None and tools.calls and structured:
        raise APIError("A forced tool call answers with its arguments: it cannot be combined with a JSON "
                       "`response_format`.", param="response_format", code="invalid_value")


def parse_tool_calls(param: str, calls: Any) -> tuple[dict[str, Any], ...]:
    """An assistant message's `tool_calls`, as chat templates take them: arguments that are JSON become the
    object they spell (templates write `arguments | tojson`), as transformers and vLLM hand them over."""
    if calls is None:
        return ()
    if not isinstance(calls, list):
        raise invalid_param(param, f"`{param}` must be an array.")
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments", "{}") if isinstance(function, dict) else None
        if not isinstance(name, str) or not isinstance(arguments, str) or not isinstance(call.get("id", ""), str):
            raise invalid_param(f"{param}[{i}]", f"`{param}[{i}]` must be {{\"id\": ..., \"type\": \"function\", "
                                "\"function\": {\"name\": <string>, \"arguments\": <JSON text>}}.")
        try:
            parsed: Any = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            parsed = arguments
        out.append({"id": call.get("id", ""), "type": "function", "function": {"name": name, "arguments": parsed}})
    return tuple(out)
