"""The fake upstream's aiohttp app: the scripted OpenAI routes (behaviour fields and gates as
tests/support/fake_upstream.py describes them; faults in fake_faults.py, PD legs in fake_upstream_pd.py),
the worker's ops routes (/health, /load, /kv_events) and the test's /stats and /control."""
from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import orjson
from aiohttp import web

from cache.block_hash import ROOT_HASH
from cache.kv_events import DEVICE, KvEvent, KvEventType
from tests.support import fake_faults, fake_text_engine
from tests.support.fake_upstream_pd import claim, pd_leg, release_hold
from tests.support.fake_upstream_state import FakeState, chunk_event, full_answer, gate, pass_gate


async def completions(request: web.Request) -> web.StreamResponse:
    state, body = await _received(request)
    if state.role == "prefill" or (state.role == "decode" and "kv_transfer_params" in body):
        return await pd_leg(request, state, body)    # else a decode worker serves a whole request, as ours do
    behaviour = body.get("fake") or (orjson.loads(request.headers["x-fake"]) if "x-fake" in request.headers
                                     else state.behaviour)
    if not behaviour and not body.get("stream"):
        fast = state.fast_bodies[request.path.endswith("chat/completions")]
        return web.Response(body=fast, content_type="application/json")
    return await _scripted(request, state, body, behaviour or {})


async def embeddings(request: web.Request) -> web.Response:
    """One vector per input, `[index, words or token ids in it]`; usage counts those as prompt tokens. A
    behaviour's `status` answers that error instead."""
    state, body = await _received(request)
    status = (body.get("fake") or state.behaviour).get("status", 200)
    if status != 200:
        error = {"error": {"message": f"fake {status} from {state.name}", "type": "fake", "param": None,
                           "code": str(status)}}
        return web.Response(status=status, body=orjson.dumps(error), content_type="application/json")
    given = body["input"]
    inputs = given if isinstance(given, list) and not all(isinstance(t, int) for t in given) else [given]
    sizes = [len(x) if isinstance(x, list) else len(x.split()) for x in inputs]
    data = [{"object": "embedding", "index": i, "embedding": [float(i), float(n)]} for i, n in enumerate(sizes)]
    return web.json_response({"object": "list", "data": data, "model": body.get("model", ""), "served_by": state.name,
                              "usage": {"prompt_tokens": sum(sizes), "total_tokens": sum(sizes)}})


async def _received(request: web.Request) -> tuple[FakeState, dict[str, Any]]:
    """The request's body, counted and remembered for /stats."""
    state: FakeState = request.app["state"]
    body = orjson.loads(await request.read())
    state.num_requests += 1
    state.request_ids.append(request.headers.get("x-request-id", ""))
    state.models.append(body.get("model", ""))
    state.last_headers = dict(request.headers)
    state.last_body = body
    state.arrivals.append(time.time())
    return state, body


async def _scripted(request: web.Request, state: FakeState, body: dict[str, Any],
                    behaviour: dict[str, Any]) -> web.StreamResponse:
    if behaviour.get("die"):
        os._exit(3)
    if behaviour.get("stall_s"):
        await asyncio.sleep(behaviour["stall_s"])
    await pass_gate(state, behaviour.get("stall_gate"))
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
    if behaviour.get("text_engine") and body.get("stream") and not chat:
        return await fake_text_engine.serve(request, state, body, behaviour)
    num_chunks = int(behaviour.get("chunks", 3))
    model = body.get("model", "")
    if not body.get("stream"):
        if behaviour.get("first_chunk_delay_s"):
            await asyncio.sleep(behaviour["first_chunk_delay_s"])
        await pass_gate(state, behaviour.get("first_chunk_gate"))
        return web.Response(body=full_answer(state, model, num_chunks, chat, behaviour.get("usage", True)),
                            content_type="application/json")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    if behaviour.get("first_chunk_delay_s"):
        await asyncio.sleep(behaviour["first_chunk_delay_s"])
    await pass_gate(state, behaviour.get("first_chunk_gate"))
    for i in range(num_chunks):
        if behaviour.get("reset_after") is not None and i == behaviour["reset_after"]:
            request.transport.abort()
            return response
        if i and behaviour.get("chunk_delay_s"):
            await asyncio.sleep(behaviour["chunk_delay_s"])
        if i:
            await pass_gate(state, behaviour.get("chunk_gate"))
        await response.write(chunk_event(state, model, i, chat))
    await response.write(b"data: [DONE]\n\n")
    await pass_gate(state, behaviour.get("done_gate"))
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
                              "released": state.released,
                              "request_ids": state.request_ids, "models": state.models,
                              "last_headers": state.last_headers, "last_body": state.last_body,
                              "waiting": {name: n for name, n in state.waiting.items() if n},
                              "kv_since": state.kv_since})


async def control(request: web.Request) -> web.Response:
    """POST {"behaviour": {...}, "times": N (then back to {}), "healthy": bool, "load_report": {...},
    "kv_stored": [block hashes of one prompt, in order], "kv_removed": [block hashes], "kv_block_size": 16,
    "kv_medium": "device" (or "cpu", "disk", "store": where kv_stored/kv_removed happen),
    "kv_events": [raw events, served verbatim], "reset_stats": true, "release": {gate: permits},
    "refuses_kv": bool (PD decode: every leg's KV refused with kv_transfer_mismatch)}."""
    state: FakeState = request.app["state"]
    body = await request.json()
    if "behaviour" in body:
        state.behaviour, state.behaviour_times = body["behaviour"], body.get("times")
    if "healthy" in body:
        state.healthy = bool(body["healthy"])
    if "load_report" in body:
        state.load_report = body["load_report"]
    if "refuses_kv" in body:
        state.refuses_kv = bool(body["refuses_kv"])
    if "kv_events" in body:
        state.kv_events.extend(body["kv_events"])
    for key, kind in (("kv_stored", KvEventType.STORED), ("kv_removed", KvEventType.REMOVED)):
        if key in body:
            _append_kv_events(state, kind, body[key], body.get("kv_block_size", 16), body.get("kv_medium", DEVICE))
    if body.get("reset_stats"):
        state.num_requests, state.request_ids, state.models = 0, [], []
    for name, permits in body.get("release", {}).items():
        for _ in range(permits):
            gate(state, name).release()
    return web.json_response({"ok": True})


def make_app(state: FakeState) -> web.Application:
    app = web.Application()
    app["state"] = state
    state.fast_bodies = {chat: full_answer(state, "fake", 3, chat, True) for chat in (True, False)}
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/health", health)
    app.router.add_get("/load", load)
    app.router.add_get("/kv_events", kv_events)
    app.router.add_get("/stats", stats)
    app.router.add_post("/control", control)
    app.router.add_get("/fake_kv/{transfer_id}", claim)
    app.router.add_post("/kv_holds/release", release_hold)
    app.cleanup_ctx.append(_client_ctx)
    return app


async def _client_ctx(app: web.Application) -> Any:
    import aiohttp
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as client:
        app["client"] = client
        yield
