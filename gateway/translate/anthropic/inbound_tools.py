"""Tool use in a Messages request, as the chat completions body carries it: `tools` and `tool_choice`, and the
content blocks of a conversation that used tools (an assistant's `tool_use`, a user's `tool_result`); and an
answer's tool calls as `tool_use` blocks.

Pure: no I/O. Bad requests raise `BadRequest` (the /v1/messages route renders it in Anthropic's shape).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from gateway.errors import BadRequest

# Blocks of Claude's own reasoning, sent back with the conversation: no chat template takes them, and they
# carry nothing the answer needs (Anthropic itself drops them from earlier turns).
SKIPPED_BLOCKS = frozenset({"thinking", "redacted_thinking"})


def chat_tools(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat fields for the request's `tools` and `tool_choice` (none when it has no tools)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if isinstance(choice, dict) and choice.get("type") in ("any", "tool"):
            raise BadRequest("tool_choice: asks for a tool call, but the request has no tools", param="tool_choice")
        return {}
    if not isinstance(tools, list):
        raise BadRequest("tools: an array of tool definitions", param="tools")
    functions = [_function(tool, f"tools.{index}") for index, tool in enumerate(tools)]
    out: dict[str, Any] = {"tools": functions}
    if choice is not None:
        names = {f["function"]["name"] for f in functions}
        out["tool_choice"], parallel = _tool_choice(choice, names)
        if not parallel:
            out["parallel_tool_calls"] = False
    return out


def _function(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise BadRequest(f"{where}: a tool definition object", param=where)
    kind = tool.get("type")
    if kind is not None and kind != "custom":
        raise BadRequest(f"{where}: Anthropic's server tool {tool.get('type')!r} is not available here; "
                         "define the tool with name, description and input_schema", param=f"{where}.type")
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequest(f"{where}.name: field required (a non-empty string)", param=f"{where}.name")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise BadRequest(f"{where}.input_schema: field required (a JSON schema object)", param=f"{where}.input_schema")
    function: dict[str, Any] = {"name": name, "parameters": schema}
    description = tool.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise BadRequest(f"{where}.description: a string", param=f"{where}.description")
        function["description"] = description
    return {"type": "function", "function": function}


def _tool_choice(choice: Any, names: set[str]) -> tuple[str | dict[str, Any], bool]:
    """(OpenAI's tool_choice, whether several calls may come in one turn)."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    parallel = not (isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is True)
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or name not in names:
            raise BadRequest(f"tool_choice.name: {name!r} is not one of the request's tools", param="tool_choice.name")
        return {"type": "function", "function": {"name": name}}, parallel
    raise BadRequest("tool_choice: an object whose type is 'auto', 'any', 'tool' or 'none'", param="tool_choice")


def chat_messages(role: str, content: Any, where: str) -> list[dict[str, Any]]:
    """One Messages-API message as chat messages: an assistant's text and tool_use blocks become one message
    with `tool_calls`; a user's tool_result blocks become `tool` messages, followed by one user message of
    its text blocks, if it has any."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list) or not content:
        raise BadRequest(f"{where}: a string or a non-empty array of content blocks", param=where)
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for index, block in enumerate(content):
        at = f"{where}.{index}"
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_call(block, at))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, at))
        elif not isinstance(kind, str) or kind not in SKIPPED_BLOCKS or role != "assistant":
            raise BadRequest(f"{at}: a {role} message's content blocks may be text"
                             f"{', tool_use' if role == 'assistant' else ', tool_result'}, not {kind!r}", param=at)
    text = "\n".join(texts)
    if calls:
        return [{"role": "assistant", "content": text or None, "tool_calls": calls}]
    if not results:
        return [{"role": role, "content": text}]
    return results + ([{"role": "user", "content": text}] if texts else [])


def _tool_call(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
        raise BadRequest(f"{where}: a tool_use block has a non-empty id and name", param=where)
    if not isinstance(arguments, dict):
        raise BadRequest(f"{where}.input: an object", param=f"{where}.input")
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": orjson.dumps(arguments).decode()}}


def _tool_result(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A tool_result as a `tool` message. Its `is_error` has no field in the chat form: the text says it."""
    call_id, content = block.get("tool_use_id"), block.get("content", "")
    if not isinstance(call_id, str) or not call_id:
        raise BadRequest(f"{where}.tool_use_id: field required (a non-empty string)", param=f"{where}.tool_use_id")
    if isinstance(content, list):
        parts = []
        for index, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"{where}.content.{index}: only text blocks are supported in a tool_result, "
                                 f"not {kind!r}", param=f"{where}.content.{index}")
            parts.append(part["text"])
        content = "\n".join(parts)
    elif not isinstance(content, str):
        raise BadRequest(f"{where}.content: a string or an array of text blocks", param=f"{where}.content")
    if block.get("is_error") is True:
        content = f"Error: {content}" if content else "Error"
    return {"role": "tool", "tool_call_id": call_id, "content": content}


# --- the answer --------------------------------------------------------------------------------------

def tool_use_blocks(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """An OpenAI answer message's tool calls as `tool_use` blocks."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return []
    blocks = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        blocks.append({"type": "tool_use", "id": call.get("id") or "", "name": function.get("name") or "",
                       "input": tool_input(function.get("arguments"))})
    return blocks


def tool_input(arguments: Any) -> Any:
    """A call's arguments (a JSON string) as a tool_use block's `input`. A model's arguments that are not a
    JSON object are kept as they came, under the one key a client can find them by."""
    if isinstance(arguments, str):
        try:
            value = orjson.loads(arguments or "{}")
        except orjson.JSONDecodeError:
            return {"arguments": arguments}
        return value if isinstance(value, dict) else {"arguments": arguments}
    return arguments if isinstance(arguments, dict) else {}
