"""The KV listener's pool key on real worker processes (bundled SmolLM2, fp32 CPU, --threads 1): P1 prefills with
the key from $SWITCHYARD_KV_KEY, D1 decodes with it from --kv-key, BAD decodes with another key. A raw client
without the key and BAD's pulls are refused and counted on P1, the hold survives them, no block leaks, and D1's
pull after them gives transformers' answer.
"""
from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import pytest
import torch

from backends.core.sampling_params import SamplingParams
from backends.kv_transfer import KVErrorCode
from backends.kv_transfer.protocol import HEADER_SIZE, FrameType, decode_header, decode_json_meta, encode_json_frame
from tests.backends.engine.test_engine_model import hf_greedy
from tests.backends.numerics import assert_same_tokens, choices, logit_tolerance
from tests.backends.pd_cluster import COMMON
from tests.backends.pd_http import assert_idle, get, get_text, post
from tests.backends.references import prompt_ids, smollm2_vocabulary
from tests.support.worker_proc import WorkerProcess

KEY = "pool-key-for-this-test"
BODY = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.0,
        "return_token_ids": True}


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, WorkerProcess]]:
    log_dir = tmp_path_factory.mktemp("kv-auth")
    started = {"p1": WorkerProcess(["--role", "prefill", *COMMON], env={"SWITCHYARD_KV_KEY": KEY}, log_dir=log_dir,
                                   wait=False),
               "d1": WorkerProcess(["--role", "decode", "--kv-key", KEY, *COMMON], log_dir=log_dir, wait=False),
               "bad": WorkerProcess(["--role", "decode", "--kv-key", "not-" + KEY, *COMMON], log_dir=log_dir,
                                    wait=False)}
    try:
        for worker in started.values():
            worker.wait_healthy()
        yield started
    finally:
        for worker in started.values():
            worker.stop()


async def refused(url: str) -> dict[str, float]:
    text = await get_text(url + "/metrics")
    return {m[1]: float(m[2]) for m in
            re.finditer(r'switchyard_kv_transfer_refused_connections_total\{reason="(\w+)"\} (\S+)', text)}


async def raw_pull_without_key(host: str, port: int, transfer_id: str) -> list[tuple[FrameType, dict[str, object]]]:
    """What a stranger gets who connects and asks for a hold at once: every frame until the listener closes."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(encode_json_frame(FrameType.PULL, {"transfer_id": transfer_id, "num_blocks": 1}))
    frames = []
    while header_bytes := await reader.read(HEADER_SIZE):
        header = decode_header(header_bytes)
        frames.append((header.frame_type,
                       decode_json_meta(header.frame_type, await reader.readexactly(header.meta_len))))
    writer.close()
    return frames


async def test_only_the_pool_key_pulls_kv(workers: dict[str, WorkerProcess], hf_smollm2: torch.nn.Module,
                                          hf_smollm2_f64: torch.nn.Module) -> None:
    p1, d1, bad = workers["p1"], workers["d1"], workers["bad"]
    assert await refused(p1.url) == {"missing": 0.0, "wrong": 0.0}
    status, pre = await post(p1.url, {**BODY, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200, pre
    kv = pre["kv_transfer_params"]
    num_held = len(kv["remote_block_ids"])
    assert (await get(p1.url + "/load"))["num_held_blocks"] == num_held

    frames = await raw_pull_without_key(kv["remote_host"], kv["remote_port"], kv["remote_request_id"])
    assert [f for f, _ in frames] == [FrameType.CHALLENGE, FrameType.ERROR], frames
    assert frames[1][1]["code"] == KVErrorCode.UNAUTHORIZED.value
    status, err = await post(bad.url, {**BODY, "kv_transfer_params": {**kv, "response_id": pre["id"]}})
    assert status == 503 and err["error"]["code"] == "kv_transfer_failed", err
    assert "unauthorized" in err["error"]["message"], err
    counts = await refused(p1.url)
    assert counts["missing"] == 1 and counts["wrong"] >= 1, counts
    assert (await get(p1.url + "/load"))["num_held_blocks"] == num_held   # neither read nor released
    assert p1.log().count("logged once per peer") == 1, p1.log()   # one warning for 127.0.0.1, then info lines

    status, dec = await post(d1.url, {**BODY, "kv_transfer_params": {**kv, "response_id": pre["id"]}})
    assert status == 200, dec
    got = kv["first_token_ids"] + dec["choices"][0]["token_ids"]
    tokenizer, eos = smollm2_vocabulary()
    prompt = prompt_ids(tokenizer, BODY, chat=False)
    (want, want_logits), = hf_greedy(hf_smollm2, [prompt], len(got), eos)
    tolerance = logit_tolerance(hf_smollm2, hf_smollm2_f64, [prompt + want])
    expected = choices(want_logits, SamplingParams(max_tokens=len(got), temperature=0.0), None, eos, tolerance)
    assert_same_tokens(got, want, expected, "P1's first token and D1's pull with the pool key")
    assert (await refused(p1.url))["missing"] == 1
    await assert_idle([p1.url, d1.url, bad.url])
