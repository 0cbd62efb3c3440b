"""A scripted fake OpenAI-compatible upstream, run as its own process (`python -m tests.support.fake_upstream`).

Behaviour per request comes from the body's `"fake"` object (unknown fields pass through the gateway)
or the `x-fake` header (JSON), else from the process default (CLI `--behaviour JSON` or POST /control).
Fields: status, retry_after, stall_s (before headers), first_chunk_delay_s, chunks, chunk_delay_s,
reset_after (abort the connection after that many chunks), die (exit the process), usage, and
fault (cut, malformed and oversized answers: tests/support/fake_faults.py).
Gates hold a request at the same four points until the test lets it go, so a test orders events
without a clock: stall_gate, first_chunk_gate, chunk_gate (before every chunk after the first) and
done_gate (after `data: [DONE]`, before the body's end) name a gate; each pass takes one permit
(POST /control {"release": {name: n}}); GET /stats reports how many requests wait at each gate.
GET /stats reports what it received, so tests can count upstream hits.
GET /kv_events answers as a worker does (backends/server/ops_routes.py); its events are built by
cache.kv_events.KvEvent, the parser's own schema, so the fake cannot drift from what the gateway reads
(tests/cache/test_prefix_index.py holds that schema to the worker's).
PD mode (`--role prefill|decode`) follows docs/disaggregation.md; see `_pd_prefill` / `_pd_decode`.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from cache.block_hash import ROOT_HASH
from cache.kv_events import DEVICE, KvEvent, KvEventType
from tests.support import fake_faults
from tests.support.ports import free_port
from tests.support.wait import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]


class FakeState:
    def __init__(self, name: str, behaviour: dict[str, Any], role: str = "both") -> None:
        self.name = name
        self.role = role                  # both | prefill | decode
        self.behaviour = behaviour
        self.behaviour_times: int | None = None  # the default behaviour applies this many more times
        self.held: set[str] = set()       # PD prefill: transfer ids whose "blocks" are held
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


def _gate(state: FakeState, name: str) -> asyncio.Semaphore:
    return state.gates.setdefault(name, asyncio.Semaphore(0))


async def _pass(state: FakeState, name: str | None) -> None:
    """Wait for one permit of gate `name` (None: no gate)."""
    if name is None:
        return
    state.waiting[name] += 1
    try:
        await _gate(state, name).acquire()
    finally:
        state.waiting[name] -= 1


def _chunk(state: FakeState, model: str, index: int, chat: bool) -> bytes:
    text = f"tok{index} "
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": None} if chat else \
        {"index": 0, "text": text, "finish_reason": None}
    event = {"id": "fake", "object": "chat.completion.chunk" if chat else "text_completion", "model": model,
             "served_by": state.name, "choices": [choice]}
    return b"data: " + orjson.dumps(event) + b"\n\n"


def _full(state: FakeState, model: str, num_chunks: int, chat: bool, usage: bool) -> bytes:
    text = "".join(f"tok{i} " for i in range(num_chunks))
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"} if chat \
        else {"index": 0, "text": text, "finish_reason": "stop"}
    body: dict[str, Any] = {"id": "fake", "object": "chat.completion" if chat else "text_completion",
                            "model": model, "served_by": state.name, "choices": [choice]}
    if usage:
        body["usage"] = {"prompt_tokens": 7, "completion_tokens": num_chunks, "total_tokens": 7 + num_chunks,
                         "prompt_tokens_details": {"cached_tokens": 3}}
    return orjson.dumps(body)


async def completions(request: web.Request) -> web.StreamResponse:
    state: FakeState = request.app["state"]
    raw = await request.read()
    body = orjson.loads(raw)
    state.num_requests += 1
    state.request_ids.append(request.headers.get("x-request-id", ""))
    model = body.get("model", "")
    state.models.append(model)
    state.last_headers = dict(request.headers)
    state.last_body = body
    state.arrivals.append(time.time())
    if state.role != "both":
        return await _pd_leg(request, state, body)
    behaviour = body.get("fake") or (orjson.loads(request.headers["x-fake"]) if "x-fake" in request.headers
                                     else state.behaviour)
    if not behaviour and not body.get("stream"):
        fast = state.fast_bodies[request.path.endswith("chat/completions")]
        return web.Response(body=fast, content_type="application/json")
    return await _scripted(request, state, body, behaviour or {})


async def _scripted(request: web.Request, state: FakeState, body: dict[str, Any],
                    behaviour: dict[str, Any]) -> web.StreamResponse:
    if behaviour.get("die"):
        os._exit(3)
    if behaviour.get("stall_s"):
        await asyncio.sleep(behaviour["stall_s"])
    await _pass(state, behaviour.get("stall_gate"))
    if behaviour.get("fault"):
        return await fake_faults.serve(request, state.name, body, behaviour)
    status = behaviour.get("status", 200)
    if status != 200:
        headers = {"Retry-After": str(behaviour["retry_after"])} if "retry_after" in behaviour else {}
        error = {"error": {"message": f"fake {status} from {state.name}", "type": "fake", "param": None,
                           "code": str(status)}}
        return web.Response(status=status, body=orjson.dumps(error), content_type="application/json",
                            headers=headers)
    chat = request.path.endswith("chat/completions")
    num_chunks = int(behaviour.get("chunks", 3))
    model = body.get("model", "")
    if not body.get("stream"):
        if behaviour.get("first_chunk_delay_s"):
            await asyncio.sleep(behaviour["first_chunk_delay_s"])
        await _pass(state, behaviour.get("first_chunk_gate"))
        return web.Response(body=_full(state, model, num_chunks, chat, behaviour.get("usage", True)),
                            content_type="application/json")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    if behaviour.get("first_chunk_delay_s"):
        await asyncio.sleep(behaviour["first_chunk_delay_s"])
    await _pass(state, behaviour.get("first_chunk_gate"))
    for i in range(num_chunks):
        if behaviour.get("reset_after") is not None and i == behaviour["reset_after"]:
            request.transport.abort()
            return response
        if i and behaviour.get("chunk_delay_s"):
            await asyncio.sleep(behaviour["chunk_delay_s"])
        if i:
            await _pass(state, behaviour.get("chunk_gate"))
        await response.write(_chunk(state, model, i, chat))
    await response.write(b"data: [DONE]\n\n")
    await _pass(state, behaviour.get("done_gate"))
    await response.write_eof()
    return response


def _default_behaviour(state: FakeState) -> dict[str, Any]:
    behaviour = state.behaviour
    if state.behaviour_times is not None:
        state.behaviour_times -= 1
        if state.behaviour_times <= 0:
            state.behaviour, state.behaviour_times = {}, None
    return behaviour


def _error(status: int, message: str, code: str) -> web.Response:
    body = {"error": {"message": message, "type": "fake", "param": None, "code": code}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


async def _pd_leg(request: web.Request, state: FakeState, body: dict[str, Any]) -> web.StreamResponse:
    """PD mode: `fake.prefill` / `fake.decode` in the body (or the process default) script the leg;
    besides the usual fields, `code` sets the error code of a non-200 and `finish` the prefill's finish_reason."""
    behaviour = (body.get("fake") or {}).get(state.role) or _default_behaviour(state)
    if behaviour.get("die"):
        os._exit(3)
    if behaviour.get("stall_s"):
        await asyncio.sleep(behaviour["stall_s"])
    await _pass(state, behaviour.get("stall_gate"))
    if behaviour.get("status", 200) != 200:
        return _error(behaviour["status"], f"fake {behaviour['status']} from {state.name}",
                      behaviour.get("code", str(behaviour["status"])))
    handler = _pd_prefill if state.role == "prefill" else _pd_decode
    return await handler(request, state, body, behaviour)


async def _pd_prefill(request: web.Request, state: FakeState, body: dict[str, Any],
                      behaviour: dict[str, Any]) -> web.StreamResponse:
    """Checks the leg is a prefill leg (or a plain one-token request); answers the first token and, for
    a leg, holds a transfer id."""
    leg = body.get("kv_transfer_params") == {"do_remote_decode": True}
    if body.get("max_tokens") != 1 or body.get("stream") or "max_completion_tokens" in body or \
            "stream_options" in body or not (leg or "kv_transfer_params" not in body):
        return _error(400, f"fake prefill: not a prefill leg: {body}", "bad_prefill_leg")
    chat = request.path.endswith("chat/completions")
    finish = behaviour.get("finish", "length")
    state.num_transfers += 1
    transfer_id = f"xfer-{state.name}-{state.num_transfers}"
    message = {"role": "assistant", "content": "first "}
    payload: dict[str, Any] = {
        "id": f"cmpl-{transfer_id}", "object": "chat.completion" if chat else "text_completion", "created": 1,
        "model": body.get("model"), "served_by": state.name,
        "choices": [{"index": 0, "finish_reason": finish,
                     **({"message": message} if chat else {"text": message["content"]})}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8,
                  "prompt_tokens_details": {"cached_tokens": 3}}}
    if leg and finish != "stop":
        state.held.add(transfer_id)
        payload["kv_transfer_params"] = {
            "do_remote_prefill": True, "remote_engine_id": state.name, "remote_host": "127.0.0.1",
            "remote_port": request.transport.get_extra_info("sockname")[1], "remote_block_ids": [1, 2],
            "remote_request_id": transfer_id, "num_prompt_tokens": 7, "first_token_ids": [42],
            "num_cached_tokens": 3}
    return web.Response(body=orjson.dumps(payload), content_type="application/json")


async def claim(request: web.Request) -> web.Response:
    """PD prefill: the decode fake's stand-in for a KV pull; each held transfer can be claimed once."""
    state: FakeState = request.app["state"]
    transfer_id = request.match_info["transfer_id"]
    if transfer_id not in state.held:
        raise web.HTTPNotFound()
    state.held.discard(transfer_id)
    return web.json_response({"ok": True})


async def _pd_decode(request: web.Request, state: FakeState, body: dict[str, Any],
                     behaviour: dict[str, Any]) -> web.StreamResponse:
    """Checks it got the prefill's kv_transfer_params, claims the transfer, streams tokens after the first."""
    params = body.get("kv_transfer_params") or {}
    if not params.get("do_remote_prefill") or params.get("first_token_ids") != [42]:
        return _error(400, f"fake decode: no kv_transfer_params from a prefill: {params}", "bad_decode_leg")
    url = f"http://{params['remote_host']}:{params['remote_port']}/fake_kv/{params['remote_request_id']}"
    with contextlib.suppress(OSError):
        async with request.app["client"].get(url) as claimed:
            if claimed.status == 200:
                return await _pd_stream(request, state, body, behaviour, params.get("response_id") or "decode")
    return _error(503, f"fake decode: transfer {params['remote_request_id']} is not held", "kv_transfer_failed")


async def _pd_stream(request: web.Request, state: FakeState, body: dict[str, Any], behaviour: dict[str, Any],
                     response_id: str) -> web.StreamResponse:
    chat = request.path.endswith("chat/completions")
    num_chunks = int(behaviour.get("chunks", 3))
    usage = {"prompt_tokens": 7, "completion_tokens": num_chunks + 1, "total_tokens": 8 + num_chunks,
             "prompt_tokens_details": {"cached_tokens": 7}}  # the decode's view: the whole prompt arrived
    if not body.get("stream"):
        full = orjson.loads(_full(state, body.get("model", ""), 0, chat, False))
        text = "".join(f"tok{i} " for i in range(1, num_chunks + 1))
        full["choices"][0].update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        full.update(id=response_id, usage=usage)
        return web.Response(body=orjson.dumps(full), content_type="application/json")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for i in range(1, num_chunks + 1):
        if i > 1 and behaviour.get("chunk_delay_s"):
            await asyncio.sleep(behaviour["chunk_delay_s"])
        if i > 1:
            await _pass(state, behaviour.get("chunk_gate"))
        event = orjson.loads(_chunk(state, body.get("model", ""), i, chat)[6:])
        event["id"] = response_id
        await response.write(b"data: " + orjson.dumps(event) + b"\n\n")
    if (body.get("stream_options") or {}).get("include_usage"):
        await response.write(b"data: " + orjson.dumps({"id": response_id, "choices": [], "usage": usage}) + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def health(request: web.Request) -> web.Response:
    state: FakeState = request.app["state"]
    return web.json_response({"status": "ok" if state.healthy else "down"}, status=200 if state.healthy else 503)


async def load(request: web.Request) -> web.Response:
    state: FakeState = request.app["state"]
    if state.load_report is None:
        raise web.HTTPNotFound()
    return web.json_response(state.load_report)


async def kv_events(request: web.Request) -> web.Response:
    """The workers' semantics: the events with seq_no > since; `next` is the last one's seq_no. A raw
    event without an integer seq_no (a malformed one a test planted) is always served."""
    state: FakeState = request.app["state"]
    since = int(request.query.get("since", "0"))
    state.kv_since = since
    events = [e for e in state.kv_events if (n := _seq_no(e)) is None or n > since]
    seq_nos = [n for n in map(_seq_no, events) if n is not None]
    return web.json_response({"events": events, "next": max(seq_nos, default=since), "reset": False})


def _seq_no(event: dict[str, Any]) -> int | None:
    seq_no = event.get("seq_no")
    return seq_no if isinstance(seq_no, int) else None


def _append_kv_events(state: FakeState, kind: KvEventType, block_hashes: list[int], block_size: int,
                      medium: str) -> None:
    """Events for blocks as a worker emits them: stored blocks form one chain (the first one's parent
    is ROOT_HASH), removed ones have no parent; seq_no goes on from the last."""
    seq_no = max((n for n in map(_seq_no, state.kv_events) if n is not None), default=0)
    parent: int | None = ROOT_HASH if kind is KvEventType.STORED else None
    for block_hash in block_hashes:
        seq_no += 1
        state.kv_events.append(KvEvent(seq_no, kind, block_hash, parent, block_size, medium).to_mapping())
        if kind is KvEventType.STORED:
            parent = block_hash


async def stats(request: web.Request) -> web.Response:
    state: FakeState = request.app["state"]
    return web.json_response({"name": state.name, "num_requests": state.num_requests, "arrivals": state.arrivals,
                              "held": sorted(state.held), "num_transfers": state.num_transfers,
                              "request_ids": state.request_ids, "models": state.models,
                              "last_headers": state.last_headers, "last_body": state.last_body,
                              "waiting": {name: n for name, n in state.waiting.items() if n},
                              "kv_since": state.kv_since})


async def control(request: web.Request) -> web.Response:
    """POST {"behaviour": {...}, "times": N (then back to {}), "healthy": bool, "load_report": {...},
    "kv_stored": [block hashes of one prompt, in order], "kv_removed": [block hashes], "kv_block_size": 16,
    "kv_medium": "device" (or "cpu", "disk", "store": where kv_stored/kv_removed happen),
    "kv_events": [raw events, served verbatim], "reset_stats": true, "release": {gate: permits}}."""
    state: FakeState = request.app["state"]
    body = await request.json()
    if "behaviour" in body:
        state.behaviour, state.behaviour_times = body["behaviour"], body.get("times")
    if "healthy" in body:
        state.healthy = bool(body["healthy"])
    if "load_report" in body:
        state.load_report = body["load_report"]
    if "kv_events" in body:
        state.kv_events.extend(body["kv_events"])
    for key, kind in (("kv_stored", KvEventType.STORED), ("kv_removed", KvEventType.REMOVED)):
        if key in body:
            _append_kv_events(state, kind, body[key], body.get("kv_block_size", 16), body.get("kv_medium", DEVICE))
    if body.get("reset_stats"):
        state.num_requests, state.request_ids, state.models = 0, [], []
    for name, permits in body.get("release", {}).items():
        for _ in range(permits):
            _gate(state, name).release()
    return web.json_response({"ok": True})


def make_app(state: FakeState) -> web.Application:
    app = web.Application()
    app["state"] = state
    state.fast_bodies = {chat: _full(state, "fake", 3, chat, True) for chat in (True, False)}
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/load", load)
    app.router.add_get("/kv_events", kv_events)
    app.router.add_get("/stats", stats)
    app.router.add_post("/control", control)
    app.router.add_get("/fake_kv/{transfer_id}", claim)
    app.cleanup_ctx.append(_client_ctx)
    return app


async def _client_ctx(app: web.Application) -> Any:
    import aiohttp
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as client:
        app["client"] = client
        yield


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="fake")
    parser.add_argument("--behaviour", default="{}", help="default behaviour (JSON)")
    parser.add_argument("--role", default="both", choices=["both", "prefill", "decode"])
    args = parser.parse_args()
    import uvloop
    uvloop.install()
    web.run_app(make_app(FakeState(args.name, orjson.loads(args.behaviour), args.role)), host="127.0.0.1",
                port=args.port, access_log=None, print=None, shutdown_timeout=0.1)


# --- the test-side handle -------------------------------------------------------------------------

class FakeUpstream:
    """Starts the fake as a process; `url` is its base URL."""

    def __init__(self, name: str = "fake", behaviour: dict[str, Any] | None = None, wait: bool = True,
                 role: str = "both") -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.fake_upstream", "--port", str(self.port), "--name", name,
             "--behaviour", orjson.dumps(behaviour or {}).decode(), "--role", role], cwd=REPO_ROOT)
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        _wait_http(self.url + "/health", self._proc)

    def get(self, path: str) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + path, timeout=5) as response:
            return orjson.loads(response.read())

    def stats(self) -> dict[str, Any]:
        return self.get("/stats")

    def control(self, **fields: Any) -> None:
        request = urllib.request.Request(self.url + "/control", data=orjson.dumps(fields), method="POST",
                                         headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=5).read()

    def release(self, gate: str, permits: int = 1) -> None:
        """Let `permits` requests (or chunks) past `gate`; permits not yet needed are kept for later ones."""
        self.control(release={gate: permits})

    def num_waiting(self, gate: str) -> int:
        """Requests held at `gate` right now."""
        return self.stats()["waiting"].get(gate, 0)

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def kill(self) -> None:
        """Die abruptly (SIGKILL): open connections are reset, nothing is flushed."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 20.0, ok_status: int = 200) -> None:
    def answers() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as response:
            return response.status == ok_status
        return False

    wait_until(answers, f"{url} to answer {ok_status}", timeout_s=timeout_s)


@contextlib.contextmanager
def fake_upstreams(*names: str) -> Iterator[list[FakeUpstream]]:
    fakes = [FakeUpstream(name, wait=False) for name in names]
    try:
        for fake in fakes:
            fake.wait_ready()
        yield fakes
    finally:
        for fake in fakes:
            fake.stop()


if __name__ == "__main__":
    main()
