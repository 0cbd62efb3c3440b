"""Tiny random Mixtral, Qwen3-MoE and DeepSeek-V3 checkpoints (transformers' config classes, from_config; 8 experts,
top-2; DeepSeek-V3's latent attention with q through q_a / q_b, and, served by TP=2 only, through one q_proj) served
by one rank, by a tensor-parallel group of two (`--tensor-parallel-size 2`: every expert's columns split, DeepSeek's
query heads and shared expert too), by an expert-parallel group of two (`--enable-expert-parallel`: 4 whole
experts per rank) and, for Qwen3-MoE and DeepSeek-V3, by two pipeline stages (`--pipeline-parallel-size 2`), gloo
on the CPU:

- the groups' greedy tokens are the single rank's (and transformers'), served directly and through the gateway,
  and their logprobs the single rank's within float32 rounding;
- each rank reads only its slices or its own experts, each stage its own layers (their bytes, in each group's
  start-up log);
- a size that does not divide the experts, or the experts' width, is refused at start, with the reason.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from transformers import PreTrainedModel

from backends.core.sampling_params import SamplingParams
from tests.backends.engine.test_engine_model import hf_greedy
from tests.backends.executor.ranks import gone, rank_pids
from tests.backends.executor.tp_checkpoints import tiny_moe_checkpoint
from tests.backends.models.moe_checkpoints import float64_twin
from tests.backends.numerics import assert_mostly_clear, assert_same_tokens, choices, logit_tolerance
from tests.backends.pd_http import assert_idle, post
from tests.backends.references import prompt_ids, smollm2_vocabulary
from tests.support.gateway_proc import GatewayProcess
from tests.support.wait import wait_until
from tests.support.worker_proc import REPO_ROOT, WorkerProcess, started_workers

pytestmark = pytest.mark.slow

NAME = "tiny-moe"
MAX_TOKENS = 10
BODY = {"model": NAME, "prompt": "The capital of France is", "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "return_token_ids": True, "logprobs": 1}
COMMON = ["--threads", "1", "--num-blocks", "32", "--served-model-name", NAME]
GROUPS = {"tp2": ["--tensor-parallel-size", "2"], "ep2": ["--tensor-parallel-size", "2", "--enable-expert-parallel"]}
STAGES = {"pp2": ["--pipeline-parallel-size", "2"]}
# the groups each family is served by: DeepSeek-V3 without q_lora_rank differs in its attention only, which EP=2
# splits as TP=2 does (one group fewer to start); Mixtral's stages run the code Qwen3-MoE's do
FAMILY_GROUPS = {"mixtral": GROUPS, "qwen3-moe": {**GROUPS, **STAGES}, "deepseek-v3": {**GROUPS, **STAGES},
                 "deepseek-v3-q-full": {"tp2": GROUPS["tp2"]}}
# |logprob| differences of the same tokens, a group against one rank: float32 rounding of sums taken in another
# order (the bound held in every run; the largest difference itself is not recorded)
MAX_LOGPROB_DIFF = 1e-4
_WEIGHTS = re.compile(r"rank (\d): ([\d.]+) MB of weights \(read ([\d.]+) MB of slices\)")


@dataclass(frozen=True)
class Served:
    family: str
    folder: Path
    model: PreTrainedModel                 # transformers' float32 model on the checkpoint's weights
    workers: dict[str, WorkerProcess]      # "tp1" (one rank), "tp2" and "ep2" (the groups; FAMILY_GROUPS)

    @property
    def groups(self) -> dict[str, list[str]]:
        return FAMILY_GROUPS[self.family]

    def url(self, name: str) -> str:
        return self.workers[name].url


@pytest.fixture(scope="module", params=list(FAMILY_GROUPS))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    model = tiny_moe_checkpoint(request.param, folder)
    args = {"tp1": ["--model", str(folder), *COMMON],
            **{name: ["--model", str(folder), *flags, *COMMON] for name, flags in FAMILY_GROUPS[request.param].items()}}
    with started_workers(args, tmp_path_factory.mktemp(f"{request.param}-workers")) as workers:
        ranks = [pid for name in FAMILY_GROUPS[request.param] for pid in rank_pids(workers[name].pid)]
        assert len(ranks) == len(FAMILY_GROUPS[request.param]), ranks   # rank 1 of each group
        yield Served(request.param, folder, model, workers)
    wait_until(lambda: all(gone(pid) for pid in ranks), "the groups' ranks to exit with their workers")


def completion(body: dict[str, object]) -> tuple[list[int], list[float]]:
    choice = body["choices"][0]   # type: ignore[index]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


async def test_tp2_and_ep2_give_one_ranks_greedy_tokens(served: Served, tmp_path: Path) -> None:
    tokenizer, eos = smollm2_vocabulary()
    prompt = prompt_ids(tokenizer, BODY, chat=False)
    (want, logits), = hf_greedy(served.model, [prompt], MAX_TOKENS, eos)
    tolerance = logit_tolerance(served.model, float64_twin(served.model), [prompt + want])
    reference = choices(logits, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), None, eos, tolerance)
    assert_mostly_clear([reference], "transformers' greedy tokens")

    answers = {}
    for name in ("tp1", *served.groups):
        status, body = await post(served.url(name), BODY)
        assert status == 200, body
        answers[name] = completion(body)
        assert_same_tokens(answers[name][0], want, reference, f"{served.family} {name} against transformers")
    one_ids, one_logprobs = answers["tp1"]
    for name in served.groups:
        ids, logprobs = answers[name]
        assert ids == one_ids, f"{served.family} {name} against one rank"
        worst = max(abs(a - b) for a, b in zip(logprobs, one_logprobs, strict=True))
        assert worst <= MAX_LOGPROB_DIFF, f"{served.family} {name}: logprobs {worst:.2e} from one rank's"

    gateway = GatewayProcess({   # both groups behind one model: whichever it picks answers one rank's tokens
        "models": {NAME: {"tokenizer": str(served.folder), "providers": ["groups"]}},
        "providers": {"groups": {"kind": "openai", "endpoints": [served.url(n) for n in served.groups],
                                 "offers_load": True}},
    }, tmp_path, start_timeout_s=120)   # its import and first health checks: over 30 s on a loaded 2-core VM
    try:
        for _ in served.groups:
            status, body = await post(gateway.url, BODY)
            assert status == 200, body
            assert body["choices"][0]["token_ids"] == one_ids
    finally:
        gateway.stop()
    await assert_idle([served.url(name) for name in ("tp1", *served.groups)])


def test_each_rank_reads_only_its_slices_or_its_experts(served: Served) -> None:
    """Each rank of a tensor- or expert-parallel group reads about half of the checkpoint's bytes (the norms and the
    routers whole; DeepSeek-V3's latent projections too); the stages of a pipeline read it once between them (the
    final norm twice), the second stage its layers only."""
    total = sum(path.stat().st_size for path in served.folder.glob("*.safetensors"))
    for name in served.groups:
        read = {int(rank): float(mb) * 1e6 for rank, _, mb in _WEIGHTS.findall(served.workers[name].log())}
        assert sorted(read) == [0, 1], served.workers[name].log()
        if name in STAGES:   # MB to one decimal in the log: within 0.1 MB of the file (its header included)
            assert abs(sum(read.values()) - total) < 0.2e6 and 0 < read[1] < 0.5 * total, (name, read, total)
            continue
        for rank, read_bytes in read.items():
            assert 0.45 * total < read_bytes < 0.55 * total, (name, rank, read_bytes, total)


@pytest.mark.parametrize(("flags", "config", "message"), [
    (["--tensor-parallel-size", "4", "--enable-expert-parallel"], {"num_local_experts": 6},
     "--tensor-parallel-size 4 with --enable-expert-parallel does not divide the model's 6 experts"),
    (["--tensor-parallel-size", "4"], {"intermediate_size": 42},
     "--tensor-parallel-size 4 does not divide the model's 42 expert columns"),
    (["--enable-expert-parallel"], {}, "--enable-expert-parallel splits the experts over a group's ranks"),
])
def test_a_size_the_experts_do_not_divide_is_refused_at_start(served: Served, tmp_path: Path, flags: list[str],
                                                              config: dict[str, int], message: str) -> None:
    """Refused from config.json alone, before any rank starts or any weight is read."""
    if served.family != "mixtral":
        pytest.skip("one family is enough: the check reads the config only")
    folder = tmp_path / "model"
    folder.mkdir()
    data = json.loads((served.folder / "config.json").read_text(encoding="utf-8"))
    (folder / "config.json").write_text(json.dumps({**data, **config}), encoding="utf-8")
    shutil.copy(served.folder / "tokenizer.json", folder / "tokenizer.json")
    done = subprocess.run([sys.executable, "-m", "backends.server", "--port", "1", "--model", str(folder), *flags],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert message in done.stderr, done.stderr
