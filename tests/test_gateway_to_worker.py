"""End to end: the unchanged OpenAI SDK → a real gateway → a real worker on the bundled model.

The reference is transformers' own `generate` on the same weights, not our own output.
"""
from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import orjson
import pytest
import torch

from tests.support.gateway_proc import GatewayProcess
from tests.support.worker_proc import worker_process

pytestmark = pytest.mark.slow

API_KEY = "sk-e2e-secret"
NEW_TOKENS = 24
QUESTIONS = ["What is the capital of France?", "Name three primary colours."]


@pytest.fixture(scope="module")
def gateway_url(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    workdir = tmp_path_factory.mktemp("e2e")
    with worker_process(["--model", "smollm2", "--served-model-name", "smollm2", "--max-num-seqs", "8"],
                        log_dir=workdir) as worker_url:
        config = {
            "api_keys": [{"key_id": "team-a", "key": API_KEY, "max_requests_per_min": 1000}],
            "models": {"smollm2": {"tokenizer": str(smollm2_dir), "providers": ["local"],
                                   "policy": {"name": "session_affinity"}}},
            "providers": {"local": {"kind": "openai", "endpoints": [worker_url],
                                    "offers_load": True, "offers_kv_events": True}},
        }
        gateway = GatewayProcess(config, workdir)
        try:
            yield gateway.url
        finally:
            gateway.stop()


def hf_answer(hf_smollm2: torch.nn.Module, smollm2_dir: Path, question: str) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.inference_mode():
        out = hf_smollm2.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                  do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_sdk_chat_through_gateway_matches_transformers(gateway_url: str, hf_smollm2, smollm2_dir: Path) -> None:
    client = openai.OpenAI(base_url=gateway_url + "/v1", api_key=API_KEY, max_retries=0)
    for question in QUESTIONS:
        expected = hf_answer(hf_smollm2, smollm2_dir, question)
        reply = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=NEW_TOKENS,
                                               messages=[{"role": "user", "content": question}])
        assert reply.choices[0].message.content == expected
        assert reply.usage.completion_tokens <= NEW_TOKENS and reply.usage.prompt_tokens > 5

        stream = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=NEW_TOKENS,
                                                messages=[{"role": "user", "content": question}], stream=True,
                                                stream_options={"include_usage": True},
                                                extra_headers={"x-session-affinity": "agent-1"})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == expected
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_usage_and_prefix_cache_are_reported(gateway_url: str) -> None:
    client = openai.OpenAI(base_url=gateway_url + "/v1", api_key=API_KEY, max_retries=0)
    system = "You are a concise assistant for a railway company. " * 8  # several full KV blocks
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hello!"}]
    first = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=4, messages=messages)
    second = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=4, messages=messages)
    assert second.usage.prompt_tokens_details.cached_tokens >= 16 * 4
    assert second.choices[0].message.content == first.choices[0].message.content

    request = urllib.request.Request(gateway_url + "/v1/usage", headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        usage = orjson.loads(resp.read())
    assert usage["key_id"] == "team-a"
    assert usage["num_cached_tokens"] >= second.usage.prompt_tokens_details.cached_tokens
    assert usage["num_completion_tokens"] >= first.usage.completion_tokens + second.usage.completion_tokens


def test_bad_key_and_bad_input_never_reach_the_worker(gateway_url: str) -> None:
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gateway_url + "/v1", api_key="wrong", max_retries=0).chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "hi"}])
    client = openai.OpenAI(base_url=gateway_url + "/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smollm2", messages="not a list")  # type: ignore[arg-type]
    # and the system still serves
    ok = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=2,
                                        messages=[{"role": "user", "content": "hi"}])
    assert ok.choices[0].finish_reason in ("stop", "length")
