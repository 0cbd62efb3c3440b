"""Tool use on the worker, pure parts: what `tools` / `tool_choice` become (tools.py), and how a forced call's
text is read as `tool_calls` (tool_call_output.py): cut anywhere, the stream's deltas add up to the calls
`json.loads` reads in the whole text."""
from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from backends.server.errors import APIError
from backends.server.protocol import ParseContext, RequestKind, parse_request
from backends.server.tool_call_output import ToolCallText
from backends.server.tools import ToolCalling, parse_tools
from backends.structured_output.json_output import compiled_schema
from tests.backends.structured_output.test_json_schema import valid

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}}, "$defs": {"zone": {"type": "string"}}}}}
NOW = {"type": "function", "function": {"name": "now"}}      # no parameters: arguments are {}


def tools_of(**fields: Any) -> ToolCalling | None:
    return parse_tools({"tools": [WEATHER, TIME, NOW], **fields})


def test_a_named_function_constrains_to_its_arguments() -> None:
    calling = tools_of(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert calling is not None and calling.forced == "get_weather" and calling.calls
    schema = json.loads(calling.schema or "")
    root = WEATHER["function"]["parameters"]
    assert schema == {"type": "object", **root}
    assert [t["function"]["name"] for t in calling.tools] == ["get_weather", "get_time", "now"]


def test_required_constrains_to_an_array_of_calls_whose_refs_still_resolve() -> None:
    calling = tools_of(tool_choice="required")
    assert calling is not None and calling.forced is None
    schema = json.loads(calling.schema or "")
    good = [{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "now", "arguments": {}},
            {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]
    assert valid(good, schema, schema)
    for bad in ([], [{"name": "get_time", "arguments": {"zone": 3}}], [{"name": "now", "arguments": {"x": 1}}],
                [{"name": "get_weather", "arguments": {"unit": "celsius"}}], [{"name": "other", "arguments": {}}]):
        assert not valid(bad, schema, schema), bad
    compiled_schema(calling.schema or "")      # and the grammar compiler takes it
    single = json.loads(tools_of(tool_choice="required", parallel_tool_calls=False).schema or "")  # type: ignore[union-attr]
    assert not valid(good, single, single) and valid(good[:1], single, single)


def test_parameters_by_reference_or_union_are_taken_as_written() -> None:
    """Pydantic writes a model's parameters as a `$ref` into `$defs`; a union is an anyOf: neither gains keywords
    (the grammar takes no `$ref` beside `type`), and references resolve from inside the array "required" makes."""
    by_ref = {"$ref": "#/$defs/Args", "$defs": {"Args": {"type": "object", "properties": {"x": {"type": "integer"}},
                                                         "required": ["x"]}}}
    union = {"anyOf": [{"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
                       {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": by_ref}},
             {"type": "function", "function": {"name": "g", "parameters": union}}]
    named = parse_tools({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert named is not None and json.loads(named.schema or "") == by_ref
    required = parse_tools({"tools": tools, "tool_choice": "required"})
    schema = json.loads(required.schema or "") if required is not None else None
    assert valid([{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {"b": 2}}], schema, schema)
    assert not valid([{"name": "f", "arguments": {"x": "1"}}], schema, schema)
    assert not valid([{"name": "g", "arguments": {"a": 2}}], schema, schema)


def test_none_renders_the_tools_and_answers_text() -> None:
    calling = tools_of(tool_choice="none")
    assert calling is not None and not calling.calls and len(calling.tools) == 3


@pytest.mark.parametrize(("fields", "param", "code"), [
    ({"tools": [WEATHER]}, "tool_choice", "unsupported_parameter"),                    # auto: no parser here
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "unsupported_parameter"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}], "tool_choice": "required"}, "tools[0]",
     "unsupported_parameter"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "^a"}}}}}], "tool_choice": "required"},
     "tools", "unsupported_parameter"),
    ({"functions": [WEATHER["function"]]}, "functions", "unsupported_parameter"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "invalid_value"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "invalid_value"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools[1].function.name", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "required"},
     "tools[0].function.name", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters", "invalid_value"),
    ({"tools": "x", "tool_choice": "required"}, "tools", "invalid_value"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "invalid_value"),
    ({"tools": [WEATHER], "tool_choice": "required", "ignore_eos": True}, "tool_choice", "invalid_value"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls", "invalid_value"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "a", "function": {"name": 1}}]}]},
     "messages[0].tool_calls[0]", "invalid_value"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]}, "messages[0].tool_call_id",
     "invalid_value"),
])
def test_what_is_refused(fields: dict[str, Any], param: str, code: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(APIError) as refused:
        parse_request(RequestKind.CHAT, body, ParseContext(("smollm2",), 1000))
    assert (refused.value.param, refused.value.code, refused.value.status) == (param, code, 400)


def test_history_with_calls_and_answers_parses_for_the_template() -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
                    {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "not json"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    req = parse_request(RequestKind.CHAT, {"messages": messages, "tools": [WEATHER], "tool_choice": "none"},
                        ParseContext(("smollm2",), 1000))
    assert req.messages is not None
    calls = req.messages[1].tool_calls
    assert calls[0]["function"]["arguments"] == {"city": "Paris"} and calls[1]["function"]["arguments"] == "not json"
    assert req.messages[2].tool_call_id == "call_1" and req.params.json_schema is None


# --- reading a forced call's text ----------------------------------------------------------------------------

_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(alphabet='ab{}[]",:\\ é\n', max_size=6),
                       lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.text(alphabet='ab{}"\\', max_size=4), inner, max_size=3),
                       max_leaves=8)
_arguments = st.dictionaries(st.text(alphabet='xy{}"\\', max_size=4), _values, max_size=3)
_calls = st.lists(st.tuples(st.sampled_from(["get_weather", "now", "a\"b"]), _arguments), min_size=1, max_size=3)


def _spaced(rng: random.Random) -> str:
    return rng.choice(["", "", " ", "\n  "])


def _required_text(calls: list[tuple[str, dict[str, Any]]], rng: random.Random) -> tuple[str, list[str]]:
    """The array a "required" answer is, with whitespace where the grammar allows it, and each call's arguments
    as written in it."""
    parts, written = ["["], []
    for i, (name, arguments) in enumerate(calls):
        args = json.dumps(arguments, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
        written.append(args)
        parts += [_spaced(rng), "," if i else "", _spaced(rng), "{", _spaced(rng), '"name"', _spaced(rng), ":",
                  _spaced(rng), json.dumps(name), _spaced(rng), ",", _spaced(rng), '"arguments"', _spaced(rng), ":",
                  _spaced(rng), args, _spaced(rng), "}"]
    parts += [_spaced(rng), "]"]
    return "".join(parts), written


def _cut(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(0, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _added_up(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls a client assembles from the stream's `tool_calls` deltas (as the OpenAI SDKs do)."""
    calls: list[dict[str, Any]] = []
    for delta in deltas:
        if delta["index"] == len(calls):
            assert delta["id"].startswith("call_") and delta["type"] == "function", delta
            calls.append({"id": delta["id"], "name": delta["function"]["name"], "arguments": ""})
        else:
            assert delta["index"] == len(calls) - 1 and "id" not in delta and "name" not in delta["function"]
        calls[-1]["arguments"] += delta["function"]["arguments"]
    return calls


@settings(max_examples=300, deadline=None)
@given(_calls, st.randoms(use_true_random=False))
def test_required_text_cut_anywhere_adds_up_to_its_calls(calls: list[tuple[str, dict[str, Any]]],
                                                          rng: random.Random) -> None:
    text, written = _required_text(calls, rng)
    reader = ToolCallText(ToolCalling((), None, "{}"))
    deltas = [d for piece in _cut(text, rng) for d in reader.feed(piece)]
    streamed = _added_up(deltas)
    assert [(c["name"], c["arguments"]) for c in streamed] == [(n, w) for (n, _), w in zip(calls, written,
                                                                                            strict=True)]
    assert [json.loads(c["arguments"]) for c in streamed] == [a for _, a in calls]
    assert [c["id"] for c in streamed] == [c.id for c in reader.calls]
    whole = ToolCallText(ToolCalling((), None, "{}"))
    whole.feed(text)
    assert [(c.name, c.arguments) for c in whole.calls] == [(c["name"], c["arguments"]) for c in streamed]


@settings(max_examples=100, deadline=None)
@given(_arguments, st.randoms(use_true_random=False))
def test_a_named_calls_text_is_its_arguments(arguments: dict[str, Any], rng: random.Random) -> None:
    text = json.dumps(arguments)
    reader = ToolCallText(ToolCalling((), "get_weather", "{}"))
    streamed = _added_up([d for piece in _cut(text, rng) for d in reader.feed(piece)])
    assert streamed == [{"id": reader.calls[0].id, "name": "get_weather", "arguments": text}]


def test_a_cut_short_answer_keeps_the_calls_begun_and_text_of_another_shape_ends_the_reading() -> None:
    reader = ToolCallText(ToolCalling((), None, "{}"))
    reader.feed('[{"name": "now", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Par')
    assert [(c.name, c.arguments) for c in reader.calls] == [("now", "{}"), ("get_weather", '{"city": "Par')]
    other = ToolCallText(ToolCalling((), None, "{}"))
    assert other.feed('{"name": "now"}') == [] and other.feed('[{"name": "now", "arguments": {}}]') == []
    assert other.calls == []
