"""Disaggregated serving with two revisions of a model in the pools (a rolling upgrade halfway), on real worker
processes (fp32 CPU, --threads 1): P1 prefills and D1 decodes on the bundled SmolLM2, NEW decodes on a second
revision in a folder of the same name (tests/backends/conftest.smollm2_revision_dir). Answers are checked against
transformers on the weights that computed them.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from backends.core.sampling_params import SamplingParams
from tests.backends.engine.test_engine_model import hf_greedy
from tests.backends.numerics import assert_same_tokens, choices, float64_copy, logit_tolerance
from tests.backends.pd_cluster import COMMON, gateway_config
from tests.backends.pd_http import assert_idle, get, get_text, post, stream
from tests.backends.references import prompt_ids, smollm2_vocabulary
from tests.gateway.conftest import metric
from tests.support.gateway_proc import GatewayProcess
from tests.support.worker_proc import WorkerProcess, started_workers

BODY = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 10, "temperature": 0.0,
        "return_token_ids": True}


@pytest.fixture(scope="module")
def workers(smollm2_revision_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, WorkerProcess]]:
    roles = {"p1": ["--role", "prefill"], "d1": ["--role", "decode"],
             "new": ["--role", "decode", "--model", str(smollm2_revision_dir), "--served-model-name", "smollm2"]}
    with started_workers({name: [*args, *COMMON] for name, args in roles.items()},
                         tmp_path_factory.mktemp("pd-revisions")) as workers:
        yield workers


def check_greedy(model: torch.nn.Module, context: list[int], got: list[int], what: str) -> None:
    """`got` against transformers' greedy tokens after `context`, up to where float32 rounding decides."""
    _, eos = smollm2_vocabulary()
    (want, want_logits), = hf_greedy(model, [context], len(got), eos)
    tolerance = logit_tolerance(model, float64_copy(model), [context + want])
    expected = choices(want_logits, SamplingParams(max_tokens=len(got), temperature=0.0), None, eos, tolerance)
    assert_same_tokens(got, want, expected, what)


async def test_a_decode_worker_on_other_weights_refuses_their_kv(workers: dict[str, WorkerProcess],
                                                                 hf_smollm2: torch.nn.Module,
                                                                 smollm2_revision_dir: Path, tmp_path: Path) -> None:
    """A rolling upgrade halfway: a decode worker whose folder has the model's name holds a new revision. The KV
    that P1 holds was computed by the old weights, and decoding on from it would give tokens that neither revision
    computes. The new worker refuses it (400 kv_transfer_mismatch, naming the weights) and releases the hold
    (nobody asks for it again: left to expire, every such request would pin its prompt's blocks on P1), and no
    block leaks. Through a gateway that pairs P1 with the new worker, a request then runs whole on the new
    worker, and a stream goes on there from P1's first token: each matches transformers on the new weights."""
    from transformers import LlamaForCausalLM

    p1, d1, new = workers["p1"], workers["d1"], workers["new"]
    status, pre = await post(p1.url, {**BODY, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200, pre
    kv = pre["kv_transfer_params"]
    status, err = await post(new.url, {**BODY, "kv_transfer_params": kv})
    assert status == 400 and err["error"]["code"] == "kv_transfer_mismatch", err
    assert "weights: " in err["error"]["message"], err
    served = {name: re.search(r'switchyard_model_weights_info\{weights="(\w+)"\} 1\.0', text).group(1)
              for name, text in [("old", await get_text(p1.url + "/metrics")),
                                 ("new", await get_text(new.url + "/metrics"))]}
    assert served["old"] != served["new"] and served["old"] in err["error"]["message"], served
    assert (await get(new.url + "/load"))["weights"] == served["new"]   # the gateway pairs workers by it
    status, dec = await post(d1.url, {**BODY, "kv_transfer_params": {**kv, "response_id": pre["id"]}})
    assert status == 503 and dec["error"]["code"] == "kv_transfer_failed", dec   # the hold is gone:
    assert f"KV hold {kv['remote_request_id']} expired" not in p1.log()   # released

    gateway = GatewayProcess(gateway_config([p1.url], [new.url]), tmp_path)
    try:
        tokenizer, _ = smollm2_vocabulary()
        prompt = prompt_ids(tokenizer, BODY, chat=False)
        hf_new = LlamaForCausalLM.from_pretrained(str(smollm2_revision_dir), dtype=torch.float32).eval()
        status, whole = await post(gateway.url, BODY)
        assert status == 200, whole
        check_greedy(hf_new, prompt, whole["choices"][0]["token_ids"], "the request run whole on the new weights")
        events = await stream(gateway.url, BODY)
        assert all("error" not in e for e in events), events[-1]
        ids = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
        check_greedy(hf_smollm2, prompt, ids[:1], "P1's first token, on the old weights")
        check_greedy(hf_new, prompt + ids[:1], ids[1:], "the stream gone on from P1's first token")
        assert metric(gateway, "switchyard_pd_redos_total", code="kv_transfer_mismatch") == 2
    finally:
        gateway.stop()
    await assert_idle([p1.url, d1.url, new.url])
