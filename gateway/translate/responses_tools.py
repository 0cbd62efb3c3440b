"""Function tools on the Responses API in the chat completions body's form: `tools`, `tool_choice` and
`parallel_tool_calls`, and the input items of a conversation that used them (`function_call`,
`function_call_output`); and an answer's tool calls as `function_call` output items.

Pure: no I/O. Bad requests raise `BadRequest` (rendered in OpenAI's error shape).
"""
from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import orjson

from gateway.errors import BadRequest

CHOICE_MODES = frozenset({"auto", "none", "required"})
INPUT_TEXT = frozenset({"input_text"})


def chat_tools(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat fields for the request's `tools`, `tool_choice` and `parallel_tool_calls` (none of them when
    it has no tools: a chat upstream may refuse a tool_choice without tools)."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be an array of tool definitions", param="tools")
    functions = [_function(tool, f"tools[{index}]") for index, tool in enumerate(tools)]
    chat_choice = None if choice is None else _tool_choice(choice, {f["function"]["name"] for f in functions})
    if not functions:
        if chat_choice not in (None, "auto", "none"):
            raise BadRequest("'tool_choice' asks for a tool call, but the request has no tools", param="tool_choice")
        return {}
    out: dict[str, Any] = {"tools": functions}
    if chat_choice is not None:
        out["tool_choice"] = chat_choice
    if parallel is not None:
        out["parallel_tool_calls"] = parallel
    return out


def _function(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise BadRequest(f"'{where}' must be a tool definition object", param=where)
    if tool.get("type") != "function":
        raise BadRequest(f"'{where}.type': only function tools are supported, not {tool.get('type')!r}",
                         param=f"{where}.type")
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequest(f"'{where}.name' is required and must be a non-empty string", param=f"{where}.name")
    function: dict[str, Any] = {"name": name}
    for field, kind, what in (("description", str, "a string"), ("parameters", dict, "a JSON schema object"),
                              ("strict", bool, "a boolean")):
        value = tool.get(field)
        if value is None:
            continue
        if not isinstance(value, kind):
            raise BadRequest(f"'{where}.{field}' must be {what}", param=f"{where}.{field}")
        function[field] = value
    return {"type": "function", "function": function}


def _tool_choice(choice: Any, names: set[str]) -> str | dict[str, Any]:
    if isinstance(choice, str) and choice in CHOICE_MODES:
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if not isinstance(name, str) or name not in names:
            raise BadRequest(f"'tool_choice.name': {name!r} is not one of the request's function tools",
                             param="tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    raise BadRequest("'tool_choice' must be 'auto', 'none', 'required' or {type: 'function', name}",
                     param="tool_choice")


# --- input items -------------------------------------------------------------------------------------

def chat_tool_call(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A `function_call` input item as one entry of an assistant message's `tool_calls`."""
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    for field, value in (("call_id", call_id), ("name", name)):
        if not isinstance(value, str) or not value:
            raise BadRequest(f"'{where}.{field}' is required and must be a non-empty string", param=f"{where}.{field}")
    if not isinstance(arguments, str):
        raise BadRequest(f"'{where}.arguments' must be a string (the call's arguments as JSON)",
                         param=f"{where}.arguments")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_message(item: Mapping[str, Any], where: str, call_ids: set[str]) -> dict[str, Any]:
    """A `function_call_output` input item as a `tool` message; its call_id must be one of `call_ids` (the
    calls sent before it), as OpenAI requires."""
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str) or not call_id:
        raise BadRequest(f"'{where}.call_id' is required and must be a non-empty string", param=f"{where}.call_id")
    if call_id not in call_ids:
        raise BadRequest(f"'{where}.call_id': no function_call item before it has call_id {call_id!r}",
                         param=f"{where}.call_id")
    if isinstance(output, list):
        output = joined_text(output, INPUT_TEXT, "input_text", f"{where}.output")
    elif not isinstance(output, str):
        raise BadRequest(f"'{where}.output' must be a string or an array of input_text parts", param=f"{where}.output")
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def joined_text(parts: list[Any], kinds: frozenset[str], what: str, where: str) -> str:
    """Text parts (each `{type, text}`, its type one of `kinds`) joined by newlines, as the workers join them."""
    texts = []
    for index, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if not isinstance(kind, str) or kind not in kinds or not isinstance(part.get("text"), str):
            raise BadRequest(f"'{where}[{index}]': only {what} parts are supported, not {kind!r}",
                             param=f"{where}[{index}]")
        texts.append(part["text"])
    return "\n".join(texts)


# --- the answer --------------------------------------------------------------------------------------

def function_call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    """A `function_call` output item (its own id is new: `fc_...`)."""
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def function_call_items(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A whole chat answer message's tool calls as completed `function_call` output items."""
    calls = message.get("tool_calls")
    items = []
    for call in calls if isinstance(calls, list) else []:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        call_id, name, arguments = call.get("id"), function.get("name"), function.get("arguments")
        if not isinstance(arguments, str):    # an upstream that sent an object rather than its JSON
            arguments = orjson.dumps(arguments if arguments is not None else {}).decode()
        items.append(function_call_item(call_id if isinstance(call_id, str) and call_id else
                                        f"call_{uuid.uuid4().hex[:24]}", name if isinstance(name, str) else "",
                                        arguments, "completed"))
    return items
