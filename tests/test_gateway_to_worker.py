"""End to end: the unchanged OpenAI SDK → a real gateway → a real worker on the bundled model.

The reference is transformers' own `generate` on the same weights, not our own output; answers are
compared up to the first token float32 rounding could decide either way (tests/backends/numerics.py).
"""
from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import orjson
import pytest
import torch

from backends.core.sampling_params import SamplingParams
from tests.backends.numerics import (
    Choice,
    assert_mostly_clear,
    assert_same_text,
    choices,
    float64_copy,
    logit_tolerance,
)
from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_proc import GatewayProcess
from tests.support.wait import wait_until
from tests.support.worker_proc import worker_process

pytestmark = pytest.mark.slow

API_KEY = "sk-e2e-secret"
ADMIN_KEY = "sk-e2e-admin"
WORKER_KEY = "sk-worker-only"     # the worker's --api-key (from the environment): the gateway's providers send it
NEW_TOKENS = 24
QUESTIONS = ["What is the capital of France?", "Name three primary colours."]


@dataclass(frozen=True)
class E2E:
    gateway_url: str
    worker_url: str


@pytest.fixture(scope="module")
def e2e(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2E]:
    """`smollm2` is served by the real worker alone; `smollm2-chain` by the worker, then by `fallback`, a fake
    of a third-party OpenAI-compatible API (one that takes tools, as vLLM does); `smollm2-cached` by the worker,
    behind the response cache. The worker asks for a key."""
    workdir = tmp_path_factory.mktemp("e2e")
    fallback = FakeUpstream("fallback")
    with worker_process(["--model", "smollm2", "--served-model-name", "smollm2", "--max-num-seqs", "8"],
                        log_dir=workdir, env={"SWITCHYARD_WORKER_API_KEY": WORKER_KEY}) as worker_url:
        config = {
            "api_keys": [{"key_id": "team-a", "key": API_KEY, "max_requests_per_min": 1000},
                         {"key_id": "ops", "key": ADMIN_KEY, "admin": True}],
            "models": {"smollm2": {"tokenizer": str(smollm2_dir), "providers": ["local"],
                                   "policy": {"name": "session_affinity"}},
                       "smollm2-chain": {"tokenizer": str(smollm2_dir), "providers": ["local-chained", "fallback"]},
                       "smollm2-cached": {"tokenizer": str(smollm2_dir), "providers": ["local-chained"],
                                          "response_cache_ttl_s": 600}},
            "providers": {"local": {"kind": "openai", "endpoints": [worker_url], "api_key": WORKER_KEY,
                                    "offers_load": True, "offers_kv_events": True},
                          "local-chained": {"kind": "openai", "endpoints": [worker_url], "upstream_model": "smollm2",
                                            "api_key": WORKER_KEY},
                          "fallback": {"kind": "openai", "endpoints": [fallback.url]}},
        }
        gateway = GatewayProcess(config, workdir)
        try:
            yield E2E(gateway.url, worker_url)
        finally:
            gateway.stop()
            fallback.stop()


@pytest.fixture(scope="module")
def gateway_url(e2e: E2E) -> str:
    return e2e.gateway_url


@dataclass(frozen=True)
class Answer:
    tokens: list[int]          # transformers' greedy answer, up to and with EOS
    choices: list[Choice]      # where float32 rounding could have chosen another token


class Transformers:
    """transformers' greedy answers to chats, each with the tolerance measured on it (float32 against float64)."""

    def __init__(self, model: torch.nn.Module, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        from backends.engine.engine import eos_token_ids
        from backends.models.model_config import load_model_config

        self.model, self.model64 = model, float64_copy(model)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.eos = eos_token_ids(load_model_config(model_dir), model_dir)

    def answer(self, messages: list[dict[str, str]], max_new_tokens: int = NEW_TOKENS) -> Answer:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                 return_dict=True)["input_ids"]
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                      do_sample=False, output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0, ids.shape[1]:].tolist()
        tolerance = logit_tolerance(self.model, self.model64, [ids[0].tolist() + tokens])
        greedy = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
        return Answer(tokens, choices(torch.cat(out.logits).float(), greedy, None, self.eos, tolerance))

    def assert_matches(self, text: str, want: Answer, what: str) -> None:
        assert_same_text(text, want.tokens, want.choices,
                         lambda t: self.tokenizer.decode(t, skip_special_tokens=True), what)


@pytest.fixture(scope="module")
def hf(hf_smollm2: torch.nn.Module, smollm2_dir: Path) -> Transformers:
    return Transformers(hf_smollm2, smollm2_dir)


def test_sdk_chat_through_gateway_matches_transformers(gateway_url: str, hf: Transformers) -> None:
    client = openai.OpenAI(base_url=gateway_url + "/v1", api_key=API_KEY, max_retries=0)
    expected = [hf.answer([{"role": "user", "content": q}]) for q in QUESTIONS]
    assert_mostly_clear([e.choices for e in expected], "transformers' greedy answers")
    for question, want in zip(QUESTIONS, expected, strict=True):
        reply = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=NEW_TOKENS,
                                               messages=[{"role": "user", "content": question}])
        hf.assert_matches(reply.choices[0].message.content, want, question)
        assert reply.usage.completion_tokens <= NEW_TOKENS and reply.usage.prompt_tokens > 5

        stream = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=NEW_TOKENS,
                                                messages=[{"role": "user", "content": question}], stream=True,
                                                stream_options={"include_usage": True},
                                                extra_headers={"x-session-affinity": "agent-1"})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        hf.assert_matches(text, want, f"{question} (streamed)")
        if text == reply.choices[0].message.content:
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_usage_and_prefix_cache_are_reported(gateway_url: str, hf: Transformers) -> None:
    client = openai.OpenAI(base_url=gateway_url + "/v1", api_key=API_KEY, max_retries=0)
    system = "You are a concise assistant for a railway company. " * 8  # several full KV blocks
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hello!"}]
    first = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=4, messages=messages)
    second = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=4, messages=messages)
    assert second.usage.prompt_tokens_details.cached_tokens >= 16 * 4
    # The second is computed beside cache hits and may round differently: both answers are judged
    # against transformers' up to the first token rounding could decide.
    want = hf.answer(messages, max_new_tokens=4)
    for reply in (first, second):
        hf.assert_matches(reply.choices[0].message.content, want, "the cached prompt's answer")

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


def test_what_the_worker_cannot_honour_goes_to_the_next_provider(gateway_url: str) -> None:
    """The worker refuses tools with tool_choice "auto" (the default) with `unsupported_parameter`: with a provider
    after it in the chain, that one serves the request; with none, the client gets the 400 naming the field. What
    the worker serves stays there."""
    client = openai.OpenAI(base_url=gateway_url + "/v1", api_key=API_KEY, max_retries=0)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    raw = client.chat.completions.with_raw_response.create(model="smollm2-chain", messages=question, tools=tools,
                                                           max_tokens=4)
    assert orjson.loads(raw.content)["served_by"] == "fallback"
    plain = client.chat.completions.with_raw_response.create(model="smollm2-chain", messages=question, max_tokens=2)
    assert "served_by" not in orjson.loads(plain.content)      # the worker's own answer
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="smollm2", messages=question, tools=tools, max_tokens=4)
    assert refused.value.status_code == 400 and refused.value.body["param"] == "tool_choice"


def _get(url: str, key: str | None = None, body: bytes | None = None) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if body is not None:
        headers["Content-Type"] = "application/json"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_a_worker_with_a_key_answers_the_gateway_alone(e2e: E2E) -> None:
    """Started with SWITCHYARD_WORKER_API_KEY, the worker answers 401 (OpenAI's shape) to a request without its
    key or with another, on the API and on what the gateway polls; probes and metrics stay open. The gateway
    sends the provider's key on requests (every test above) and on its pollers: the worker's load reports and
    KV events reach it (its status shows them)."""
    chat = orjson.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    for path, body in (("/v1/chat/completions", chat), ("/v1/models", None), ("/load", None),
                       ("/kv_events", None), ("/kv_holds/release", b'{"transfer_id": "x"}')):
        for key in (None, "wrong", WORKER_KEY + "x"):
            status, answer = _get(e2e.worker_url + path, key, body)
            assert status == 401 and orjson.loads(answer)["error"]["code"] == "invalid_api_key", (path, key, answer)
    assert _get(e2e.worker_url + "/v1/chat/completions", WORKER_KEY, chat)[0] == 200
    assert _get(e2e.worker_url + "/load", WORKER_KEY)[0] == 200
    for path in ("/health", "/metrics", "/openapi.json"):
        assert _get(e2e.worker_url + path)[0] == 200, path

    def polled() -> bool:
        snapshot = orjson.loads(_get(e2e.gateway_url + "/status.json", ADMIN_KEY)[1])
        worker = next(e for e in snapshot["endpoints"] if e["id"] == e2e.worker_url)
        return worker["num_prompt_tokens"] is not None and worker["num_indexed_blocks"] > 0
    wait_until(polled, "the gateway's pollers to read the worker's /load and /kv_events")


def test_a_repeated_greedy_stream_is_replayed_without_the_worker(e2e: E2E, hf: Transformers) -> None:
    """A `temperature: 0` stream the worker answered (as transformers does) is served again from the gateway's
    response cache: the bytes of an answer the worker gave, and the worker counts no new request."""
    messages = [{"role": "user", "content": QUESTIONS[1]}]
    body = orjson.dumps({"model": "smollm2-cached", "messages": messages, "max_tokens": NEW_TOKENS,
                         "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})

    def stream() -> tuple[bytes, str | None]:
        request = urllib.request.Request(e2e.gateway_url + "/v1/chat/completions", data=body, headers={
            "Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.read(), response.headers.get("x-switchyard-cache")

    first, state = stream()
    assert state == "miss" and first.endswith(b"data: [DONE]\n\n")
    events = [orjson.loads(line[6:]) for line in first.split(b"\n\n") if line.startswith(b"data: {")]
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    hf.assert_matches(text, hf.answer(messages), "the stream the cache keeps")
    assert events[-1]["usage"]["completion_tokens"] > 0
    answered = [first]      # each miss until the first was kept is kept too (the last one kept is served)

    def replayed() -> bytes | None:
        answer, state = stream()
        if state == "hit":
            return answer
        answered.append(answer)
        return None
    hit = wait_until(replayed, "the stream replayed")
    assert hit in answered and hit.endswith(b"data: [DONE]\n\n")
    served = _worker_chats(e2e.worker_url)
    assert served >= 1      # the first stream's
    assert stream() == (hit, "hit") and _worker_chats(e2e.worker_url) == served


def _worker_chats(worker_url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = _get(worker_url + "/metrics")[1].decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "switchyard_requests_total" and s.labels.get("route") == "/v1/chat/completions")


def test_embeddings_through_the_gateway_are_transformers_vectors(e2e: E2E, hf: Transformers) -> None:
    """The SDK's embeddings.create through the gateway to the worker: transformers' last hidden state at each
    input's last token, normalised (within the float32 rounding measured against float64), and the key's usage
    records the prompt tokens the worker counted, with no output tokens."""
    from tests.backends.numerics import embedding_tolerance, last_token_embedding

    client = openai.OpenAI(base_url=e2e.gateway_url + "/v1", api_key=API_KEY, max_retries=0)
    usage_before = _usage(e2e.gateway_url)
    reply = client.embeddings.create(model="smollm2", input=QUESTIONS)   # the SDK asks for base64 and decodes it
    ids = [list(hf.tokenizer(text).input_ids) for text in QUESTIONS]
    tolerance = embedding_tolerance(hf.model, hf.model64, ids)
    for row, got in zip(ids, reply.data, strict=True):
        want = last_token_embedding(hf.model, row)
        assert (torch.tensor(got.embedding, dtype=torch.float64) - want).abs().max().item() <= tolerance
    assert reply.usage.prompt_tokens == sum(map(len, ids))
    usage_after = _usage(e2e.gateway_url)
    assert usage_after["num_prompt_tokens"] - usage_before["num_prompt_tokens"] == sum(map(len, ids))
    assert usage_after["num_completion_tokens"] == usage_before["num_completion_tokens"]



def _usage(gateway_url: str) -> dict[str, int]:
    status, body = _get(gateway_url + "/v1/usage", API_KEY)
    assert status == 200, body
    return orjson.loads(body)
