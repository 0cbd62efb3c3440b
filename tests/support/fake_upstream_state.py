"""What one fake upstream process holds (tests/support/fake_upstream.py): what it received, its default
behaviour, its gates, and the OpenAI-shaped answers every mode builds from `tok{i} ` text. No routes here:
the handlers live in fake_upstream_app.py (and fake_upstream_pd.py for PD legs)."""
from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import orjson


class FakeState:
    def __init__(self, name: str, behaviour: dict[str, Any], role: str = "both") -> None:
        self.name = name
        self.role = role                  # both | prefill | decode
        self.behaviour = behaviour
        self.behaviour_times: int | None = None  # the default behaviour applies this many more times
        self.held: set[str] = set()       # PD prefill: transfer ids whose "blocks" are held
        self.released: list[str] = []     # PD prefill: transfer ids POST /kv_holds/release named, in order
        self.refuses_kv = False           # PD decode: refuse every leg's KV, as a worker on other weights does
        self.num_transfers = 0
        self.arrivals: list[float] = []   # time.time() at each request's arrival
        self.healthy = True
        self.num_requests = 0
        self.request_ids: list[str] = []
        self.models: list[str] = []
        self.last_headers: dict[str, str] = {}
        self.last_body: dict[str, Any] = {}
        self.load_report: dict[str, Any] | None = None
        self.kv_events: list[dict[str, Any]] = []
        self.kv_since: int | None = None  # `since` of the last GET /kv_events: the poller has applied up to it
        self.gates: dict[str, asyncio.Semaphore] = {}  # gate name -> permits the test released
        self.waiting: Counter[str] = Counter()          # gate name -> requests held there now
        self.fast_bodies: dict[bool, bytes] = {}  # canned non-streaming answers, by "is chat"


def gate(state: FakeState, name: str) -> asyncio.Semaphore:
    return state.gates.setdefault(name, asyncio.Semaphore(0))


async def pass_gate(state: FakeState, name: str | None) -> None:
    """Wait for one permit of gate `name` (None: no gate)."""
    if name is None:
        return
    state.waiting[name] += 1
    try:
        await gate(state, name).acquire()
    finally:
        state.waiting[name] -= 1


def chunk_event(state: FakeState, model: str, index: int, chat: bool) -> bytes:
    text = f"tok{index} "
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": None} if chat else \
        {"index": 0, "text": text, "finish_reason": None}
    event = {"id": "fake", "object": "chat.completion.chunk" if chat else "text_completion", "model": model,
             "served_by": state.name, "choices": [choice]}
    return b"data: " + orjson.dumps(event) + b"\n\n"


def full_answer(state: FakeState, model: str, num_chunks: int, chat: bool, usage: bool) -> bytes:
    text = "".join(f"tok{i} " for i in range(num_chunks))
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"} if chat \
        else {"index": 0, "text": text, "finish_reason": "stop"}
    body: dict[str, Any] = {"id": "fake", "object": "chat.completion" if chat else "text_completion",
                            "model": model, "served_by": state.name, "choices": [choice]}
    if usage:
        body["usage"] = {"prompt_tokens": 7, "completion_tokens": num_chunks, "total_tokens": 7 + num_chunks,
                         "prompt_tokens_details": {"cached_tokens": 3}}
    return orjson.dumps(body)
