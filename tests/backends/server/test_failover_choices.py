"""Mid-stream failover of the streams that carry more than one choice's text, on real workers (bundled SmolLM2)
behind the real gateway: `n` = 2, a batch of prompts (legacy /v1/completions) and forced tool calls. The worker
serving the stream is SIGKILLed once a few events came; each choice goes on on the other worker from its own
tokens, and the client gets every choice whole, once, equal to the undisturbed greedy answer.

Equal as in tests/backends/server/test_failover_workers.py: token for token up to where float32 rounding could
decide the undisturbed answer's draw either way (the continuation recomputes the output so far as a prompt).
"""
from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson
import pytest
import torch

from tests.backends.server.test_failover_workers import Fleet, Referee
from tests.backends.server.test_tools_worker import TOOLS
from tests.gateway.conftest import metric
from tests.support.worker_proc import WorkerProcess

MAX_TOKENS = 24
KILL_AFTER = 6      # events with output before the kill (each carries one choice's delta)
NAMES = {t["function"]["name"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = Fleet(tmp_path_factory.mktemp("failover-choices"))
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture(scope="module")
def referee(fleet: Fleet, hf_smollm2: torch.nn.Module, hf_smollm2_f64: torch.nn.Module) -> Referee:
    return Referee(fleet, hf_smollm2, hf_smollm2_f64)


class Assembled:
    """What a client assembles of each choice of a stream, by index."""

    def __init__(self) -> None:
        self.payloads: list[dict[str, Any]] = []
        self.ids: dict[int, list[int]] = {}
        self.text: dict[int, str] = {}
        self.calls: dict[int, list[dict[str, Any]]] = {}
        self.finishes: dict[int, list[str]] = {}
        self.roles: dict[int, int] = {}

    def add(self, payload: dict[str, Any]) -> None:
        self.payloads.append(payload)
        for choice in payload.get("choices") or ():
            k = choice["index"]
            self.ids.setdefault(k, []).extend(choice.get("token_ids") or ())
            delta = choice.get("delta", {})
            self.text[k] = self.text.get(k, "") + (choice.get("text") or delta.get("content") or "")
            self.roles[k] = self.roles.get(k, 0) + ("role" in delta)
            calls = self.calls.setdefault(k, [])
            for piece in delta.get("tool_calls") or ():
                if "id" in piece:     # a call's head: its id, type and name
                    assert piece["index"] == len(calls), piece
                    calls.append({"id": piece["id"], "name": piece["function"]["name"], "arguments": ""})
                calls[piece["index"]]["arguments"] += piece["function"]["arguments"]
            if choice.get("finish_reason") is not None:
                self.finishes.setdefault(k, []).append(choice["finish_reason"])

    @property
    def num_output_events(self) -> int:
        return sum(1 for p in self.payloads for c in p.get("choices") or () if c.get("token_ids"))


async def streamed(fleet: Fleet, path: str, body: dict[str, Any], kill_after: int | None) -> Assembled:
    """The stream to `body` through the gateway, its serving worker SIGKILLed (and restarted once the stream is
    over) after `kill_after` events with output; None: undisturbed."""
    got = Assembled()
    killed: WorkerProcess | None = None
    body = {**body, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    try:
        async with aiohttp.ClientSession() as session, session.post(fleet.gateway.url + path, json=body) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if line.startswith(b"data: {"):
                    got.add(orjson.loads(line[6:]))
                    if killed is None and kill_after is not None and got.num_output_events == kill_after:
                        killed = await fleet.serving()
                        killed.send_signal(signal.SIGKILL)
    finally:   # the next test has both workers, whatever this one found
        if killed is not None:
            await fleet.restart(killed)
    assert kill_after is None or killed is not None, "the stream ended before the kill"
    assert all("error" not in p for p in got.payloads), got.payloads[-1]
    assert {p["id"] for p in got.payloads} == {got.payloads[0]["id"]}, "one stream, one id"
    return got


def continued(fleet: Fleet) -> float:
    return metric(fleet.gateway, "switchyard_stream_failovers_total", outcome="continued")


FRANCE, COLORS = "The capital of France is", "List three colors:"
HELLO = [{"role": "user", "content": "Say hello to a friend in one sentence."}]
CASES = [   # (the stream's prompt fields, each prompt's own as a one-choice request, n, chat)
    ({"prompt": FRANCE}, [{"prompt": FRANCE}], 2, False),
    ({"prompt": [FRANCE, COLORS]}, [{"prompt": FRANCE}, {"prompt": COLORS}], 1, False),
    ({"messages": HELLO}, [{"messages": HELLO}], 2, True),
]


@pytest.mark.parametrize(("fields", "prompts", "n", "chat"), CASES, ids=["n=2", "batch", "chat n=2"])
async def test_every_choice_goes_on_from_its_own_tokens(fleet: Fleet, referee: Referee, fields: dict[str, Any],
                                                        prompts: list[dict[str, Any]], n: int, chat: bool) -> None:
    """n = 2 of one prompt (both choices greedy: the same answer, each checked on its own), or a batch of two
    prompts (each choice its own prompt's answer): every choice whole, once, after the kill."""
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    refs = [await referee.reference({**p, **sampling}, chat=chat) for p in prompts]
    before = continued(fleet)
    body = {"model": "smollm2", **fields, "n": n, **sampling}
    got = await streamed(fleet, "/v1/chat/completions" if chat else "/v1/completions", body, KILL_AFTER)
    num_choices = len(prompts) * n
    assert sorted(got.ids) == list(range(num_choices)), "every choice, none more"
    num_whole = 0
    for k in range(num_choices):
        assert got.finishes[k] == ["length"], f"choice {k}: one finish, {got.finishes[k]}"
        if chat:
            assert got.roles[k] == 1, f"choice {k}: the role is sent once"
        ref, _ = refs[k // n]
        num_whole += ref.check(got.ids[k], got.text[k], f"choice {k} after the kill")
    if num_whole == num_choices:   # the whole answer is the undisturbed one's: so is its usage
        usage = got.payloads[-1]["usage"]
        num_prompt = sum(num for _, num in refs)
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (num_prompt, num_choices * MAX_TOKENS), usage
    assert continued(fleet) == before + 1


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"],
                         ids=["named", "required"])
async def test_a_tool_call_stream_goes_on_inside_its_call(fleet: Fleet, tool_choice: Any) -> None:
    """A forced tool call (decoded under its JSON schema) killed inside its arguments: the continuation sends no
    second head or role, and the call the client assembles, its token ids and finish reason are the undisturbed
    stream's."""
    body = {"model": "smollm2", "messages": ASK, "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 96,
            "temperature": 0.0}
    whole = await streamed(fleet, "/v1/chat/completions", body, None)
    assert whole.num_output_events > KILL_AFTER + 4, f"the undisturbed call is too short to kill inside: {whole.calls}"
    assert whole.calls[0] and {c["name"] for c in whole.calls[0]} <= NAMES, whole.calls
    before = continued(fleet)
    got = await streamed(fleet, "/v1/chat/completions", body, KILL_AFTER)
    assert continued(fleet) == before + 1
    assert got.roles == {0: 1}, "the role is sent once"
    assert got.finishes == whole.finishes, (got.finishes, whole.finishes)
    assert got.ids == whole.ids
    assert [(c["name"], c["arguments"]) for c in got.calls[0]] == \
        [(c["name"], c["arguments"]) for c in whole.calls[0]]
    assert got.payloads[-1]["usage"]["completion_tokens"] == whole.payloads[-1]["usage"]["completion_tokens"]
