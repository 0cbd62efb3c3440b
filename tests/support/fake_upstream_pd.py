"""The fake upstream's PD mode (`--role prefill|decode`, following docs/disaggregation.md): a prefill leg
answers the first token and holds a transfer id, a decode leg claims that transfer from the prefill fake
(its stand-in for a KV pull) and streams the rest. A decode fake serves a request without
`kv_transfer_params` whole, as the plain fake does (our decode workers serve whole requests too). Scripted like
the plain mode, by `fake.prefill` / `fake.decode` in the body or the process default."""
from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

import orjson
from aiohttp import web

from tests.support.fake_upstream_state import FakeState, chunk_event, full_answer, pass_gate


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


async def pd_leg(request: web.Request, state: FakeState, body: dict[str, Any]) -> web.StreamResponse:
    """PD mode: `fake.prefill` / `fake.decode` in the body (or the process default) script the leg;
    besides the usual fields, `code` sets the error code of a non-200 and `finish` the prefill's finish_reason."""
    if state.refuses_kv and state.role == "decode":
        return _error(400, f"fake decode: {state.name} holds other weights", "kv_transfer_mismatch")
    behaviour = (body.get("fake") or {}).get(state.role) or _default_behaviour(state)
    if behaviour.get("die"):
        os._exit(3)
    if behaviour.get("stall_s"):
        await asyncio.sleep(behaviour["stall_s"])
    await pass_gate(state, behaviour.get("stall_gate"))
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


async def release_hold(request: web.Request) -> web.Response:
    """PD prefill: POST /kv_holds/release, as our workers serve it (the gateway's leg will never come)."""
    state: FakeState = request.app["state"]
    transfer_id = (await request.json())["transfer_id"]
    state.released.append(transfer_id)
    released = transfer_id in state.held
    state.held.discard(transfer_id)
    return web.json_response({"released": released})


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
        full = orjson.loads(full_answer(state, body.get("model", ""), 0, chat, False))
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
            await pass_gate(state, behaviour.get("chunk_gate"))
        event = orjson.loads(chunk_event(state, body.get("model", ""), i, chat)[6:])
        event["id"] = response_id
        await response.write(b"data: " + orjson.dumps(event) + b"\n\n")
    if (body.get("stream_options") or {}).get("include_usage"):
        await response.write(b"data: " + orjson.dumps({"id": response_id, "choices": [], "usage": usage}) + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
