"""Mid-stream failover through a real gateway process to fake upstreams (engines other than ours: the
continuation is text), and the pieces of gateway/upstream/mid_stream_resume.py on their own. Our workers' exact
continuation from token ids is in tests/backends/server/test_failover_workers.py."""
from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest

from gateway.config.gateway_config import ProviderConfig, ProviderKind
from gateway.upstream.legs import leg_body
from gateway.upstream.mid_stream_resume import Stitcher, Transcript, answered_so_far, without_token_ids
from gateway.upstream.so_far import ChoiceSoFar, SoFar
from tests.gateway.conftest import gateway_config, metric
from tests.gateway.test_streaming import read_events

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BREAKS = {"chunks": 5, "reset_after": 2}     # two content events, then the connection is cut


def two_providers(a: str, b: str) -> dict[str, Any]:
    """`first` (endpoint a) then `second` (endpoint b): the first leg always goes to a."""
    return gateway_config({"first": [a], "second": [b]})


def data_events(events: list[bytes]) -> list[Any]:
    return [orjson.loads(e[6:]) for e in events if e.startswith(b"data: {")]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_a_broken_stream_goes_on_elsewhere_as_one_stream(start_fakes, start_gateway, path: str) -> None:
    (a,) = start_fakes("a", behaviour=BREAKS)
    (b,) = start_fakes("b")
    gateway = start_gateway(two_providers(a.url, b.url))
    body: dict[str, Any] = {"model": "m", "max_tokens": 50, "stream": True}
    body.update({"messages": [{"role": "user", "content": "hello"}]} if path == CHAT else {"prompt": "Say: "})
    async with aiohttp.ClientSession() as client, client.post(gateway.url + path, json=body) as response:
        assert response.status == 200
        events = await read_events(response)
    assert events[-1] == b"data: [DONE]"
    payloads = data_events(events)
    assert all("error" not in p for p in payloads), payloads
    assert [p["served_by"] for p in payloads] == ["a", "a", "b", "b", "b"]
    pieces = [c["delta"].get("content", "") if path == CHAT else c["text"] for p in payloads for c in p["choices"]]
    assert "".join(pieces) == "tok0 tok1 tok0 tok1 tok2 "    # the fake's continuation starts over; ours would not
    assert all("role" not in c.get("delta", {}) for p in payloads[2:] for c in p["choices"])
    sent = b.stats()["last_body"]
    assert sent["max_tokens"] == 48                             # what is left after the 2 tokens sent
    assert sent["model"] == "second-upstream"
    if path == CHAT:
        assert sent["messages"] == [*body["messages"], {"role": "assistant", "content": "tok0 tok1 "}]
        assert sent["continue_final_message"] is True and sent["add_generation_prompt"] is False
    else:
        assert sent["prompt"] == "Say: tok0 tok1 "
    assert a.stats()["num_requests"] == 1 and b.stats()["num_requests"] == 1
    assert metric(gateway, "switchyard_stream_failovers_total", outcome="continued") == 1
    assert metric(gateway, "switchyard_stream_errors_total") == 0


async def test_an_anthropic_messages_stream_goes_on_elsewhere_as_one_message(start_fakes, start_gateway) -> None:
    """POST /v1/messages re-encodes the OpenAI stream it relays: a continuation feeds the same translation, so
    the client gets one message (one message_start, one text block, one message_stop) and no error."""
    (a,) = start_fakes("a", behaviour=BREAKS)
    (b,) = start_fakes("b")
    gateway = start_gateway(two_providers(a.url, b.url))
    body = {"model": "m", "max_tokens": 50, "stream": True, "messages": [{"role": "user", "content": "hello"}]}
    async with aiohttp.ClientSession() as client, client.post(
            gateway.url + "/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"}) as response:
        assert response.status == 200
        events = await read_events(response)
    payloads = [orjson.loads(line[6:]) for e in events for line in e.split(b"\n") if line.startswith(b"data: ")]
    kinds = [p["type"] for p in payloads]
    assert "error" not in kinds, payloads
    assert kinds.count("message_start") == kinds.count("content_block_start") == 1, kinds
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"], kinds
    text = "".join(p["delta"]["text"] for p in payloads if p["type"] == "content_block_delta")
    assert text == "tok0 tok1 tok0 tok1 tok2 "    # the fake's continuation starts over; ours would not
    assert payloads[-2]["delta"]["stop_reason"] == "end_turn", payloads[-2]
    assert payloads[-2]["usage"]["output_tokens"] == 5, payloads[-2]   # 2 before the break, 3 after
    sent = b.stats()["last_body"]
    assert sent["messages"][-1] == {"role": "assistant", "content": "tok0 tok1 "}
    assert sent["continue_final_message"] is True and sent["max_tokens"] == 48
    assert a.stats()["num_requests"] == 1 and b.stats()["num_requests"] == 1
    assert metric(gateway, "switchyard_stream_failovers_total", outcome="continued") == 1
    assert metric(gateway, "switchyard_stream_errors_total") == 0


async def test_a_hung_stream_goes_on_elsewhere_after_its_quiet_limit(start_fakes, start_gateway) -> None:
    (a,) = start_fakes("a", behaviour={"chunks": 5, "chunk_gate": "never"})   # one chunk, then silence
    (b,) = start_fakes("b")
    config = two_providers(a.url, b.url)
    config["providers"]["first"]["timeouts"]["quiet_s"] = 0.5
    gateway = start_gateway(config)
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "stream": True}
    async with aiohttp.ClientSession() as client, client.post(gateway.url + CHAT, json=body) as response:
        events = await read_events(response)
    assert [p["served_by"] for p in data_events(events)] == ["a", "b", "b", "b"]
    assert b.stats()["last_body"]["messages"][-1] == {"role": "assistant", "content": "tok0 "}
    assert metric(gateway, "switchyard_stream_failovers_total", outcome="continued") == 1


async def test_a_continuation_that_breaks_too_ends_with_an_error_event(start_fakes, start_gateway) -> None:
    a, b = start_fakes("a", "b", behaviour=BREAKS)
    gateway = start_gateway(two_providers(a.url, b.url))
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "stream": True}
    async with aiohttp.ClientSession() as client, client.post(gateway.url + CHAT, json=body) as response:
        events = await read_events(response)
    payloads = data_events(events)
    assert [p.get("served_by") for p in payloads[:-1]] == ["a", "a", "b", "b"]
    assert payloads[-1]["error"]["type"] == "upstream_error" and "mid-stream" in payloads[-1]["error"]["message"]
    assert events[-1] == b"data: [DONE]"
    assert metric(gateway, "switchyard_stream_failovers_total", outcome="continued") == 1
    assert metric(gateway, "switchyard_stream_failovers_total", outcome="failed") == 1
    assert metric(gateway, "switchyard_stream_errors_total") == 1


async def test_an_anthropic_provider_does_not_restart_a_broken_stream(start_fakes, start_gateway) -> None:
    (a,) = start_fakes("a", behaviour=BREAKS)
    (b,) = start_fakes("b")
    config = two_providers(a.url, b.url)
    config["providers"]["second"]["kind"] = "anthropic"     # would answer from the start: not a continuation
    gateway = start_gateway(config)
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "stream": True}
    async with aiohttp.ClientSession() as client, client.post(gateway.url + CHAT, json=body) as response:
        events = await read_events(response)
    payloads = data_events(events)
    assert [p.get("served_by") for p in payloads[:-1]] == ["a", "a"]
    assert "anthropic provider does not continue" in payloads[-1]["error"]["message"]
    assert b.stats()["num_requests"] == 0


@pytest.mark.parametrize(("path", "fields"), [
    (COMPLETIONS, {"prompt": [1, 2, 3]}), (COMPLETIONS, {"prompt": [[1, 2], [3]]}),
    (CHAT, {"messages": [{"role": "user", "content": "hello"}], "n": 2})],
    ids=["token-id prompt", "token-id batch", "chat n=2"])
async def test_what_text_cannot_continue_ends_with_an_error_event(start_fakes, start_gateway, path: str,
                                                                  fields: dict[str, Any]) -> None:
    """Other engines get text: a token-id prompt cannot take it, and chat has no batch to continue several
    choices in one leg (completions n > 1 and batches go on: tests/gateway/test_failover_text.py)."""
    (a,) = start_fakes("a", behaviour=BREAKS)
    (b,) = start_fakes("b")
    gateway = start_gateway(two_providers(a.url, b.url))
    body = {"model": "m", **fields, "stream": True}
    async with aiohttp.ClientSession() as client, client.post(gateway.url + path, json=body) as response:
        events = await read_events(response)
    assert data_events(events)[-1]["error"]["type"] == "upstream_error"
    assert b.stats()["num_requests"] == 0


# --- the pieces -----------------------------------------------------------------------------------

def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def test_the_transcript_holds_back_a_partial_event() -> None:
    transcript = Transcript()
    whole = event({"choices": [{"index": 0, "text": "a"}]})
    assert transcript.take_whole(whole + whole[:9]) == whole            # the second event is cut: held back
    assert transcript.take_whole(whole[9:]) == whole                    # and sent once it is whole
    assert transcript.take_whole(b"data: {\"x\"") == b""
    assert transcript.flush() == b"data: {\"x\""                       # the clean end sends what is left
    crlf = b'data: {"choices":[{"index":0,"text":"b"}]}\r\n\r\n'
    assert transcript.take_whole(crlf) == crlf                          # CRLF framing too
    assert [e["choices"][0]["text"] for e in transcript.events()] == ["a", "a", "b"]


def one(envelope: dict[str, Any], text: str, ids: tuple[int, ...] | None, num_tokens: int) -> SoFar:
    """What the client has of a one-choice answer, unfinished, without tool calls."""
    return SoFar(envelope, (ChoiceSoFar(text, ids, num_tokens, False, False),))


def test_what_the_client_has_and_when_it_cannot_be_continued() -> None:
    transcript = Transcript()
    transcript.take_whole(event({"id": "x", "created": 5, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                                           "content": ""}}]}))
    transcript.take_whole(event({"id": "x", "choices": [{"index": 0, "delta": {"content": "Hi"}, "token_ids": [7]}]}))
    transcript.take_whole(event({"id": "x", "choices": [{"index": 0, "delta": {"content": " yo"},
                                                         "token_ids": [8, 9]}]}))
    so_far = answered_so_far(transcript, chat=True)
    assert so_far == one({"id": "x", "created": 5}, "Hi yo", (7, 8, 9), 3)
    transcript.take_whole(event({"choices": [{"index": 0, "delta": {"content": "!"}}]}))   # no token ids
    assert answered_so_far(transcript, chat=True) == one({"id": "x", "created": 5}, "Hi yo!", None, 3)
    for bad in ({"error": {"message": "boom"}}, {"choices": [{"index": 1, "delta": {"content": "b"}}]}):
        broken = Transcript()
        broken.take_whole(event(bad))
        assert answered_so_far(broken, chat=True) is None, bad


def provider(offers_token_ids: bool) -> ProviderConfig:
    return ProviderConfig("p", ProviderKind.OPENAI, ("http://x",), offers_token_ids=offers_token_ids)


def test_leg_bodies() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "q"}], "max_tokens": 10, "stream": True}
    raw = orjson.dumps(body)
    assert leg_body(provider(False), body, raw, can_fail_over=True, so_far=None) == (raw, False)
    first, _ = leg_body(provider(True), body, raw, can_fail_over=True, so_far=None) or (b"", False)
    assert orjson.loads(first)["return_token_ids"] is True              # our workers: asked for token ids
    assert leg_body(provider(True), body, raw, can_fail_over=False, so_far=None) == (raw, False)
    so_far = one({"id": "x"}, "Hi yo", (7, 8, 9), 3)
    resumed, counted = leg_body(provider(True), body, raw, can_fail_over=True, so_far=so_far) or (b"", False)
    assert orjson.loads(resumed)["resume_token_ids"] == [7, 8, 9] and orjson.loads(resumed)["max_tokens"] == 10
    assert counted
    text, counted = leg_body(provider(False), body, raw, can_fail_over=True, so_far=so_far) or (b"", True)
    assert orjson.loads(text)["messages"][-1] == {"role": "assistant", "content": "Hi yo"}
    assert orjson.loads(text)["max_tokens"] == 7 and not counted
    prefilled = {**body, "messages": [*body["messages"], {"role": "assistant", "content": "Well, "}],
                 "continue_final_message": True, "add_generation_prompt": False}
    text, _ = leg_body(provider(False), prefilled, raw, can_fail_over=True, so_far=so_far) or (b"", True)
    assert orjson.loads(text)["messages"][1:] == [{"role": "assistant", "content": "Well, Hi yo"}]   # in place
    spent = one({"id": "x"}, "Hi yo", None, 10)
    assert leg_body(provider(False), body, raw, can_fail_over=True, so_far=spent) is None


def test_the_stitcher_makes_the_continuation_read_as_the_first_stream() -> None:
    so_far = one({"id": "first", "created": 1}, "Hi", None, 2)
    stitch = Stitcher(so_far, chat=True, usage_counts_so_far=False)
    chunk = event({"id": "second", "created": 2, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                                    "content": ""}}]}) + \
        event({"id": "second", "created": 2, "choices": [{"index": 0, "delta": {"content": " there"}}]}) + \
        event({"id": "second", "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 3}}) + \
        b"data: [DONE]\n\n"
    out = stitch(chunk)
    payloads = [orjson.loads(e[6:]) for e in out.split(b"\n\n") if e.startswith(b"data: {")]
    assert payloads[0] == {"id": "first", "created": 1, "choices": [{"index": 0, "delta": {"content": " there"}}]}
    assert payloads[1]["usage"] == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    assert out.endswith(b"data: [DONE]\n\n")
    exact = Stitcher(so_far, chat=True, usage_counts_so_far=True)
    assert b'"prompt_tokens":12' in exact(event({"choices": [], "usage": {"prompt_tokens": 12,
                                                                           "completion_tokens": 5}}))


def test_token_ids_are_dropped_only_where_they_are() -> None:
    chunk = b'data: {"choices":[{"index":0,"text":"a","finish_reason":null,"token_ids":[1,22]}],' \
        b'"prompt_token_ids":[3]}\n\n'
    assert without_token_ids(chunk) == b'data: {"choices":[{"index":0,"text":"a","finish_reason":null}],' \
        b'"prompt_token_ids":[3]}\n\n'
    plain = event({"choices": [{"index": 0, "text": "token_ids"}]})
    assert without_token_ids(plain) is plain


def test_each_choice_is_read_and_resumed_from_its_own_tokens() -> None:
    """n = 2 (or a batch): each index's events are its own; our workers get each choice's tokens, null for a
    whole one; text continues the unfinished ones as a batch of prompt + text; text cannot continue tool calls."""
    transcript = Transcript()
    for index, ids, finish in ((0, [7], None), (1, [7], None), (1, [8], "length"), (0, [8], None)):
        transcript.take_whole(event({"id": "x", "choices": [{"index": index, "text": str(ids[0]), "token_ids": ids,
                                                             "finish_reason": finish}]}))
    so_far = answered_so_far(transcript, chat=False, num_choices=3)
    assert so_far is not None and not so_far.finished and so_far.num_tokens == 4
    assert so_far.choices == (ChoiceSoFar("78", (7, 8), 2, False, False), ChoiceSoFar("78", (7, 8), 2, True, False),
                              ChoiceSoFar("", (), 0, False, False))
    assert answered_so_far(transcript, chat=False, num_choices=1) is None          # index 1 of one choice
    body = {"model": "m", "prompt": ["a", "b", "c"], "max_tokens": 10, "stream": True}
    resumed, counted = leg_body(provider(True), body, orjson.dumps(body), can_fail_over=True, so_far=so_far) \
        or (b"", False)
    assert orjson.loads(resumed)["resume_token_ids"] == [[7, 8], None, []] and counted
    text, counted = leg_body(provider(False), body, orjson.dumps(body), can_fail_over=True, so_far=so_far) \
        or (b"", True)
    assert orjson.loads(text) == {**body, "prompt": ["a78", "c"], "n": 1} and not counted   # whole ones not sent
    calls = Transcript()
    calls.take_whole(event({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {
        "arguments": "{"}}]}, "token_ids": [5]}]}))
    called = answered_so_far(calls, chat=True)
    assert called == SoFar({}, (ChoiceSoFar("", (5,), 1, False, True),))
    chat = {"model": "m", "messages": [{"role": "user", "content": "q"}], "stream": True}
    assert orjson.loads((leg_body(provider(True), chat, b"", can_fail_over=True, so_far=called) or (b"",))[0]) \
        ["resume_token_ids"] == [5]
    assert leg_body(provider(False), chat, b"", can_fail_over=True, so_far=called) is None


def test_the_stitcher_keeps_a_new_choice_s_role_and_counts_whole_choices() -> None:
    so_far = SoFar({"id": "first"}, (ChoiceSoFar("Hi", (1,), 1, False, False), ChoiceSoFar("", (), 0, False, False),
                                     ChoiceSoFar("Yo", (2, 3), 2, True, False)))
    stitch = Stitcher(so_far, chat=True, usage_counts_so_far=True)
    out = stitch(event({"id": "second", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}) +
                 event({"id": "second", "choices": [{"index": 1, "delta": {"role": "assistant", "content": ""}}]}) +
                 event({"choices": [], "usage": {"prompt_tokens": 6, "completion_tokens": 9}}))
    payloads = [orjson.loads(e[6:]) for e in out.split(b"\n\n") if e.startswith(b"data: {")]
    assert payloads[0]["choices"] == [{"index": 1, "delta": {"role": "assistant", "content": ""}}]
    assert payloads[1]["usage"] == {"prompt_tokens": 6, "completion_tokens": 11, "total_tokens": 17}
