"""Mid-stream failover of several choices on engines other than ours (text, gateway/upstream/text_batch.py):
a /v1/completions stream of n > 1 or a batch of prompts, broken mid-stream, goes on as one batch of each
unfinished choice's prompt + text so far, against the fake text engine (tests/support/fake_text_engine.py),
whose continuation from the text so far is the undisturbed answer."""
from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest

from gateway.upstream.mid_stream_resume import Stitcher
from gateway.upstream.so_far import ChoiceSoFar, SoFar
from gateway.upstream.text_batch import TextBatch, text_batch
from tests.gateway.conftest import gateway_config, metric
from tests.gateway.test_failover import COMPLETIONS, data_events, event, two_providers
from tests.gateway.test_streaming import read_events

CASES = {   # the client's fields, the engine's answer length and break, and the continuation leg's fields
    "n=2": ({"prompt": "A says: ", "n": 2, "max_tokens": 4}, {"chunks": 5, "reset_after": 3},
            {"prompt": ["A says: A/0/0 A/0/1 ", "A says: A/1/0 "], "n": 1, "max_tokens": 3}),
    "batch": ({"prompt": ["A says: ", "B says: "], "max_tokens": 4}, {"chunks": 5, "reset_after": 3},
              {"prompt": ["A says: A/0/0 A/0/1 ", "B says: B/0/0 "], "n": 1, "max_tokens": 3}),
    "batch, n=2": ({"prompt": ["A says: ", "B says: "], "n": 2, "max_tokens": 10}, {"chunks": 3, "reset_after": 7},
                   {"prompt": ["A says: A/0/0 A/0/1 ", "B says: B/0/0 B/0/1 ", "B says: B/1/0 "], "n": 1,
                    "max_tokens": 9}),
}


async def stream(url: str, body: dict[str, Any]) -> list[Any]:
    async with aiohttp.ClientSession() as client, client.post(url + COMPLETIONS, json=body) as response:
        assert response.status == 200
        events = await read_events(response)
    assert events[-1] == b"data: [DONE]"
    return data_events(events)


def by_choice(payloads: list[Any]) -> dict[int, tuple[str, list[str]]]:
    """Each choice index's text and the finish reasons it got."""
    out: dict[int, tuple[str, list[str]]] = {}
    for choice in (c for p in payloads for c in p["choices"]):
        text, finishes = out.get(choice["index"], ("", []))
        out[choice["index"]] = (text + choice.get("text", ""),
                                finishes + ([choice["finish_reason"]] if choice.get("finish_reason") else []))
    return out


@pytest.mark.parametrize("case", list(CASES))
async def test_several_choices_go_on_elsewhere_as_one_batch(start_fakes, start_gateway, case: str) -> None:
    fields, engine, continuation = CASES[case]
    (a,) = start_fakes("a", behaviour={"text_engine": True, **engine})
    (b,) = start_fakes("b", behaviour={"text_engine": True, "chunks": engine["chunks"]})
    gateway = start_gateway(two_providers(a.url, b.url))
    body = {"model": "m", **fields, "stream": True, "stream_options": {"include_usage": True}}
    payloads = await stream(gateway.url, body)
    assert all("error" not in p for p in payloads), payloads
    sent = b.stats()["last_body"]
    assert {k: sent.get(k) for k in continuation} == continuation
    assert sent["model"] == "second-upstream"
    undisturbed = await stream(b.url, body)
    got = by_choice(payloads)
    num_prompts = len(fields["prompt"]) if isinstance(fields["prompt"], list) else 1
    assert got == by_choice(undisturbed), (got, by_choice(undisturbed))    # each choice's text and finish reason
    assert sorted(got) == list(range(num_prompts * fields.get("n", 1)))
    assert all(len(finishes) == 1 for _, finishes in got.values()), got
    assert [p["usage"] for p in payloads if p.get("usage")] == [p["usage"] for p in undisturbed if p.get("usage")]
    assert [p["served_by"] for p in payloads][:engine["reset_after"]] == ["a"] * engine["reset_after"]
    assert a.stats()["num_requests"] == 1 and b.stats()["num_requests"] == 2    # the continuation, the reference
    assert metric(gateway, "switchyard_stream_failovers_total", outcome="continued") == 1
    assert metric(gateway, "switchyard_stream_errors_total") == 0


async def test_a_text_batch_that_breaks_too_goes_on_from_what_the_client_got(start_fakes, start_gateway) -> None:
    """n = 2 breaks at a after 3 events, its continuation at b after 5: b had run past choice 0's budget (the
    client got 2 of its 3 events, then "length"), so c continues choice 1 alone and usage counts what was sent."""
    (a,) = start_fakes("a", behaviour={"text_engine": True, "chunks": 5, "reset_after": 3})
    (b,) = start_fakes("b", behaviour={"text_engine": True, "chunks": 5, "reset_after": 5})
    (c,) = start_fakes("c", behaviour={"text_engine": True, "chunks": 5})
    gateway = start_gateway(gateway_config({"first": [a.url], "second": [b.url], "third": [c.url]}))
    body = {"model": "m", "prompt": "A says: ", "n": 2, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    payloads = await stream(gateway.url, body)
    assert all("error" not in p for p in payloads), payloads
    assert {k: c.stats()["last_body"][k] for k in ("prompt", "n", "max_tokens")} == \
        {"prompt": ["A says: A/1/0 A/1/1 A/1/2 "], "n": 1, "max_tokens": 1}
    undisturbed = await stream(c.url, body)
    assert by_choice(payloads) == by_choice(undisturbed)
    assert [p["usage"] for p in payloads if p.get("usage")] == [p["usage"] for p in undisturbed if p.get("usage")]
    assert metric(gateway, "switchyard_stream_failovers_total", outcome="continued") == 2


# --- the pieces -----------------------------------------------------------------------------------

def test_a_text_batch_reads_back_at_the_client_s_indices_each_held_to_its_budget() -> None:
    """Choices 0 and 2 of three go on (1 is whole) as leg prompts 0 and 1, with budgets 2 and 3 under one
    max_tokens of 3: leg choice 0 is stopped after 2 events, what follows of it is dropped from text and usage."""
    so_far = SoFar({"id": "first"}, (ChoiceSoFar("x ", None, 1, False, False),
                                     ChoiceSoFar("y y ", None, 2, True, False), ChoiceSoFar("", (), 0, False, False)))
    body = {"model": "m", "prompt": ["P ", "Q "], "n": 1, "max_tokens": 3}
    assert text_batch(body, so_far) is None                      # 3 choices cannot be n = 1 of 2 prompts
    body = {"model": "m", "prompt": ["P ", "Q ", "R "], "max_tokens": 3}
    batch = text_batch(body, so_far)
    assert batch == TextBatch((0, 2), ("P x ", "R "), (2, 3), 1, 9 / 6)
    assert text_batch({**body, "prompt": [[1], [2], [3]]}, so_far) is None
    stitch = Stitcher(so_far, chat=False, usage_counts_so_far=False, body=body)
    out = stitch(b"".join(event({"id": "second", "choices": [{"index": j, "text": t, "finish_reason": f}]})
                          for j, t, f in ((0, "a ", None), (1, "b ", None), (0, "a ", None), (0, "a ", "stop"),
                                          (1, "b ", "stop"))) +
                 event({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 5}}))
    payloads = [orjson.loads(e[6:]) for e in out.split(b"\n\n") if e.startswith(b"data: {")]
    assert [(c["index"], c["text"], c["finish_reason"]) for p in payloads for c in p["choices"]] == \
        [(0, "a ", None), (2, "b ", None), (0, "a ", "length"), (2, "b ", "stop")]
    assert all(p["id"] == "first" for p in payloads)
    # prompt: (5 - 1 moved) x 9/6; completion: 5 sent - 1 dropped + 3 so far
    assert payloads[-1]["usage"] == {"prompt_tokens": 6, "completion_tokens": 7, "total_tokens": 13}
    leg = SoFar({}, (ChoiceSoFar("a a a ", None, 3, True, False), ChoiceSoFar("b b ", None, 2, True, False),
                     ChoiceSoFar("", (), 0, False, False)))
    assert stitch.read_back(leg).choices == (ChoiceSoFar("a a a ", None, 2, True, False),
                                             ChoiceSoFar("", (), 0, False, False),
                                             ChoiceSoFar("b b ", None, 2, True, False))
