"""Request validation: good bodies become the right SamplingParams, bad ones the right APIError."""
from __future__ import annotations

from typing import Any

import pytest

from backends.core.sampling_params import SamplingParams
from backends.server.errors import APIError
from backends.server.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatMessage,
    ParseContext,
    RequestKind,
    parse_request,
    resolve_max_tokens,
)

CTX = ParseContext(served_model_names=("smollm2", "alias"), vocab_size=1000)
C, CHAT = RequestKind.COMPLETION, RequestKind.CHAT
MSGS = [{"role": "user", "content": "hi"}]


def body(kind: RequestKind, **fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": "smollm2"}
    base.update({"prompt": "hello"} if kind is C else {"messages": MSGS})
    base.update(fields)
    return {k: v for k, v in base.items() if v is not ...}


GOOD = [
    (C, {}, {"max_tokens": DEFAULT_COMPLETION_MAX_TOKENS}),
    (C, {"temperature": 0, "max_tokens": 64, "ignore_eos": True},
     {"temperature": 0.0, "max_tokens": 64, "ignore_eos": True}),
    (C, {"top_p": 0.5, "top_k": 40, "min_p": 0.1, "seed": 7},
     {"top_p": 0.5, "top_k": 40, "min_p": 0.1, "seed": 7}),
    (C, {"top_k": -1}, {"top_k": -1}),
    (C, {"seed": -5}, {"seed": -5}),
    (C, {"stop": "\n"}, {"stop": ("\n",)}),
    (C, {"stop": ["a", "bc", "a"]}, {"stop": ("a", "bc")}),
    (C, {"stop_token_ids": [2, 5], "min_tokens": 3}, {"stop_token_ids": (2, 5), "min_tokens": 3}),
    (C, {"presence_penalty": -2, "frequency_penalty": 1.5, "repetition_penalty": 1.2},
     {"presence_penalty": -2.0, "frequency_penalty": 1.5, "repetition_penalty": 1.2}),
    (C, {"logprobs": 3}, {"logprobs": 3}),
    (C, {"logprobs": 0}, {"logprobs": 0}),
    (C, {"n": 1, "best_of": 1, "user": "u", "unknown_field": {"x": 1}}, {}),
    (C, {"max_tokens": 5.0}, {"max_tokens": 5}),
    (C, {"temperature": None, "top_p": None, "stop": None}, {"temperature": 1.0, "top_p": 1.0}),
    (CHAT, {"logprobs": True, "top_logprobs": 5}, {"logprobs": 5}),
    (CHAT, {"logprobs": True}, {"logprobs": 0}),
    (CHAT, {"logprobs": False}, {"logprobs": None}),
    (CHAT, {"max_completion_tokens": 9, "max_tokens": 100}, {"max_tokens": 9}),
    (C, {"logit_bias": {"5": 2.5, "999": -100, "0": 100, "7": 0}},
     {"logit_bias": ((5, 2.5), (999, -100.0), (0, 100.0))}),
    (CHAT, {"logit_bias": {}}, {"logit_bias": ()}),
    (CHAT, {"logit_bias": None}, {"logit_bias": ()}),
    (CHAT, {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}}, {}),
    (CHAT, {"tool_choice": "auto", "parallel_tool_calls": False}, {}),
    (CHAT, {"response_format": {"type": "json_object"}}, {"json_object": True, "speculative": False}),
    (C, {"response_format": {"type": "json_object"}}, {"json_object": True, "speculative": False}),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"b": {"type": "integer"}, "a": {}}}}}},
     {"json_schema": '{"type":"object","properties":{"b":{"type":"integer"},"a":{}}}', "speculative": False}),
]


@pytest.mark.parametrize(("kind", "fields", "expected"), GOOD)
def test_good_bodies_give_params(kind: RequestKind, fields: dict[str, Any], expected: dict[str, Any]) -> None:
    params = parse_request(kind, body(kind, **fields), CTX).params
    for name, value in expected.items():
        assert getattr(params, name) == value, name
    untouched = set(SamplingParams.__dataclass_fields__) - set(expected) - set(fields) - {"max_tokens"}
    for name in untouched:
        assert getattr(params, name) == getattr(SamplingParams(), name), name


BAD = [
    # (kind, body or fields, status, param, code)
    (C, [1, 2], 400, None, None),
    (C, "text", 400, None, None),
    (C, {"prompt": ...}, 400, "prompt", "missing_required_parameter"),
    (CHAT, {"messages": ...}, 400, "messages", "missing_required_parameter"),
    (C, {"model": "gpt-9"}, 404, "model", "model_not_found"),
    (C, {"model": 3}, 400, "model", "invalid_value"),
    (C, {"prompt": ""}, 400, "prompt", "invalid_value"),
    (C, {"prompt": []}, 400, "prompt", "invalid_value"),
    (C, {"prompt": 12}, 400, "prompt", "invalid_value"),
    (C, {"prompt": [1, "a"]}, 400, "prompt", "invalid_value"),
    (C, {"prompt": [1, 1000]}, 400, "prompt", "invalid_value"),
    (C, {"prompt": [1, -1]}, 400, "prompt", "invalid_value"),
    (C, {"prompt": ["a", ""]}, 400, "prompt[1]", "invalid_value"),
    (C, {"prompt": [[1], [1000]]}, 400, "prompt[1]", "invalid_value"),
    (C, {"prompt": [[1], 2]}, 400, "prompt", "invalid_value"),
    (C, {"prompt": ["a"] * 65}, 400, "prompt", "invalid_value"),
    (C, {"prompt": ["a"] * 5, "n": 13}, 400, "prompt", "invalid_value"),
    (CHAT, {"messages": []}, 400, "messages", "invalid_value"),
    (CHAT, {"messages": "hi"}, 400, "messages", "invalid_value"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", "invalid_value"),
    (CHAT, {"messages": [{"role": {"a": 1}, "content": "x"}]}, 400, "messages[0].role", "invalid_value"),
    (CHAT, {"messages": [{"role": ["user"], "content": "x"}]}, 400, "messages[0].role", "invalid_value"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "invalid_value"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content",
     "invalid_value"),
    (CHAT, {"messages": [{"role": "user", "content": "a"}, 7]}, 400, "messages[1]", "invalid_value"),
    (C, {"max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    (C, {"max_tokens": "10"}, 400, "max_tokens", "invalid_value"),
    (C, {"max_tokens": True}, 400, "max_tokens", "invalid_value"),
    (C, {"max_tokens": 1.5}, 400, "max_tokens", "invalid_value"),
    (CHAT, {"max_completion_tokens": -1}, 400, "max_completion_tokens", "invalid_value"),
    (C, {"temperature": -0.1}, 400, "temperature", "invalid_value"),
    (C, {"temperature": 2.5}, 400, "temperature", "invalid_value"),
    (C, {"temperature": "hot"}, 400, "temperature", "invalid_value"),
    (C, {"top_p": 0}, 400, "top_p", "invalid_value"),
    (C, {"top_p": 1.1}, 400, "top_p", "invalid_value"),
    (C, {"top_k": -2}, 400, "top_k", "invalid_value"),
    (C, {"min_p": 1.5}, 400, "min_p", "invalid_value"),
    (C, {"seed": 2**64}, 400, "seed", "invalid_value"),
    (C, {"seed": "1"}, 400, "seed", "invalid_value"),
    (C, {"presence_penalty": 3}, 400, "presence_penalty", "invalid_value"),
    (C, {"frequency_penalty": -2.5}, 400, "frequency_penalty", "invalid_value"),
    (C, {"repetition_penalty": 0}, 400, "repetition_penalty", "invalid_value"),
    (C, {"stop": 5}, 400, "stop", "invalid_value"),
    (C, {"stop": [""]}, 400, "stop", "invalid_value"),
    (C, {"stop": [str(i) for i in range(17)]}, 400, "stop", "invalid_value"),
    (C, {"stop_token_ids": [1000]}, 400, "stop_token_ids", "invalid_value"),
    (C, {"stop_token_ids": 3}, 400, "stop_token_ids", "invalid_value"),
    (C, {"ignore_eos": "yes"}, 400, "ignore_eos", "invalid_value"),
    (C, {"min_tokens": -1}, 400, "min_tokens", "invalid_value"),
    (C, {"logprobs": 21}, 400, "logprobs", "invalid_value"),
    (C, {"logprobs": True}, 400, "logprobs", "invalid_value"),
    (CHAT, {"logprobs": 3}, 400, "logprobs", "invalid_value"),
    (CHAT, {"top_logprobs": 3}, 400, "top_logprobs", "invalid_value"),
    (CHAT, {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "invalid_value"),
    (C, {"n": 17}, 400, "n", "invalid_value"),
    (C, {"n": 2, "best_of": 1}, 400, "best_of", "unsupported_parameter"),
    (C, {"n": 0}, 400, "n", "invalid_value"),
    (C, {"best_of": 3}, 400, "best_of", "unsupported_parameter"),
    (C, {"echo": True}, 400, "echo", "unsupported_parameter"),
    (C, {"suffix": "x"}, 400, "suffix", "unsupported_parameter"),
    (C, {"stream": "true"}, 400, "stream", "invalid_value"),
    (C, {"stream_options": {"include_usage": True}}, 400, "stream_options", "invalid_value"),
    (C, {"stream": True, "stream_options": {"include_usage": 1}}, 400, "stream_options.include_usage",
     "invalid_value"),
    (C, {"user": 5}, 400, "user", "invalid_value"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice", "unsupported_parameter"),
    (CHAT, {"functions": [{"name": "f"}]}, 400, "functions", "unsupported_parameter"),
    (CHAT, {"tool_choice": "required"}, 400, "tool_choice", "invalid_value"),
    (CHAT, {"tool_choice": {"type": "function", "function": {"name": "f"}}}, 400, "tool_choice", "invalid_value"),
    (CHAT, {"response_format": {"type": "json_object"}, "ignore_eos": True}, 400, "response_format", "invalid_value"),
    (C, {"response_format": {"type": "json_object"}, "min_tokens": 2}, 400, "response_format", "invalid_value"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}}, 400,
     "response_format", "unsupported_parameter"),
    (C, {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, 400,
     "response_format.json_schema", "invalid_value"),
    (CHAT, {"response_format": {"type": "yaml"}}, 400, "response_format", "invalid_value"),
    (CHAT, {"response_format": "json"}, 400, "response_format", "invalid_value"),
    *[(kind, {"logit_bias": bias}, 400, "logit_bias", "invalid_value") for kind, bias in [
        (C, [1, 2]), (CHAT, "5"), (C, {"1000": 1}), (C, {"-1": 1}), (C, {"+5": 1}), (C, {" 5": 1}), (C, {"abc": 1}),
        (C, {"\u0663": 1}), (C, {"": 1}), (C, {"9" * 5000: 1}), (CHAT, {"5": 101}), (C, {"5": -100.5}),
        (C, {"5": "1"}), (C, {"5": True}), (C, {"5": None})]],
    *[(C, fields, 400, "resume_token_ids", "invalid_value") for fields in [
        {"resume_token_ids": []}, {"resume_token_ids": [[1]]}, {"n": 2, "resume_token_ids": [1, 2]},
        {"n": 2, "resume_token_ids": [[1]]}, {"n": 2, "resume_token_ids": [None, None]},
        {"n": 2, "resume_token_ids": [[1], [1000]]}, {"prompt": ["a", "b"], "resume_token_ids": [[1], "2"]}]],
]


@pytest.mark.parametrize(("fields", "one", "each"), [
    ({"resume_token_ids": [5, 6]}, (5, 6), ()),
    ({"n": 2, "resume_token_ids": [[5, 6], []]}, (), ((5, 6), ())),
    ({"prompt": ["a", "b"], "n": 2, "resume_token_ids": [None, [1], [], [2]]}, (), (None, (1,), (), (2,))),
])
def test_resumed_tokens_of_one_choice_or_of_each(fields: dict[str, Any], one: tuple[int, ...],
                                                 each: tuple[tuple[int, ...] | None, ...]) -> None:
    req = parse_request(C, body(C, **fields), CTX)
    assert (req.resume_token_ids, req.resume_choices) == (one, each)


@pytest.mark.parametrize(("kind", "fields", "status", "param", "code"), BAD)
def test_bad_bodies_give_errors(kind: RequestKind, fields: Any, status: int, param: str | None,
                                code: str | None) -> None:
    raw = body(kind, **fields) if isinstance(fields, dict) else fields
    with pytest.raises(APIError) as info:
        parse_request(kind, raw, CTX)
    err = info.value
    assert (err.status, err.param, err.code) == (status, param, code)
    envelope = err.body()["error"]
    assert set(envelope) == {"message", "type", "param", "code"}
    assert envelope["message"] and envelope["type"] == "invalid_request_error"


def test_prompt_forms() -> None:
    assert parse_request(C, body(C, prompt=[5, 6]), CTX).prompt_token_ids == (5, 6)
    assert parse_request(C, body(C, prompt=[[5, 6]]), CTX).prompt_token_ids == (5, 6)
    assert parse_request(C, body(C, prompt=["abc"]), CTX).prompt_text == "abc"
    assert parse_request(C, body(C, prompt=["abc"]), CTX).batch == ()
    batch = parse_request(C, body(C, prompt=["abc", [5, 6]], n=3), CTX)
    assert batch.batch == (("abc", None), (None, (5, 6))) and batch.num_sequences == 6
    assert [(r.prompt_text, r.prompt_token_ids, r.batch) for r in batch.each_prompt()] == \
        [("abc", None, ()), (None, (5, 6), ())]
    assert parse_request(C, body(C, model=...), CTX).model == "smollm2"
    assert parse_request(C, body(C, model="alias"), CTX).model == "alias"


def test_chat_messages_and_stream_flags() -> None:
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None}]
    req = parse_request(CHAT, body(CHAT, messages=msgs, stream=True, stream_options={"include_usage": True},
                                   return_token_ids=True), CTX)
    assert req.messages == (ChatMessage("system", "be brief"), ChatMessage("user", "a\nb"),
                            ChatMessage("assistant", ""))
    assert req.stream and req.include_usage and req.return_token_ids
    assert req.max_tokens is None


@pytest.mark.parametrize(("kind", "fields", "num_prompt", "max_model_len", "expected"), [
    (C, {"max_tokens": 10}, 20, 30, 10),
    (C, {}, 5, 100, DEFAULT_COMPLETION_MAX_TOKENS),
    (CHAT, {}, 20, 30, 10),                 # unset: fill the context
    (CHAT, {"max_tokens": 10}, 20, 30, 10),
])
def test_resolve_max_tokens(kind: RequestKind, fields: dict[str, Any], num_prompt: int, max_model_len: int,
                            expected: int) -> None:
    req = parse_request(kind, body(kind, **fields), CTX)
    assert resolve_max_tokens(req, num_prompt, max_model_len).max_tokens == expected


@pytest.mark.parametrize(("kind", "fields", "num_prompt", "param", "code"), [
    (C, {"max_tokens": 11}, 20, "max_tokens", "context_length_exceeded"),
    (C, {"max_tokens": 1}, 30, "prompt", "context_length_exceeded"),
    (CHAT, {}, 30, "messages", "context_length_exceeded"),
    (CHAT, {}, 0, "messages", "invalid_value"),
    (C, {"max_tokens": 4, "min_tokens": 5}, 3, "min_tokens", "invalid_value"),
])
def test_resolve_max_tokens_refuses(kind: RequestKind, fields: dict[str, Any], num_prompt: int, param: str,
                                    code: str) -> None:
    req = parse_request(kind, body(kind, **fields), CTX)
    with pytest.raises(APIError) as info:
        resolve_max_tokens(req, num_prompt, 30)
    assert (info.value.status, info.value.param, info.value.code) == (400, param, code)
