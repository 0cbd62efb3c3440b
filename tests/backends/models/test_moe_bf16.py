"""bf16 at the model level: a tiny random Mixtral, Qwen3-MoE and DeepSeek-V3, saved in bfloat16 (as checkpoints
ship), run in bfloat16 by our runner against transformers on the same weights.

The exact logits are transformers' float64 forward on the bf16 weights. bf16's rounding is measured in the same run
as numerics.logit_tolerance measures float32's, from transformers' own bf16 forward on the same tokens, but per
position: its typical (median) deviation from the exact logits, times TOLERANCE_MULTIPLE.
- Not its largest deviation: in bf16 a token whose routing is within rounding of a tie in the exact model (two
  experts, or two of DeepSeek-V3's groups, scoring alike) can take the other expert, in either engine, and that
  token's logits (and those after it that attend to it) then move by up to 4. Measured on the 2-core EPYC over
  these prompts: 0 to 4 positions of 40 per prompt, in ours and in transformers' (at different positions); both
  engines' routers agree with the exact one to the same rounding elsewhere.
- So at most MAX_ROUTED_APART of our positions may lie outside the tolerance, and our median deviation must be
  transformers' or near it. A bug (a block read from the wrong place, an unscaled or mis-packed expert, a
  truncated rotary) moves most positions by 0.1-10.
- Greedy tokens are not compared: bf16's typical deviation (0.05-0.07) is an eighth of the median top-2 gap (0.2-
  0.4) on these models, so under any tolerance that covers two bf16 evaluations too few positions are clear for
  numerics.assert_mostly_clear."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from backends.core.batch import ForwardBatch, SeqChunk
from backends.worker.model_runner import ModelRunner
from tests.backends.models.moe_checkpoints import float64_twin, tiny_deepseek_v3, tiny_moe
from tests.backends.numerics import TOLERANCE_MULTIPLE

BLOCK = 4
VOCAB = 97
MAX_ROUTED_APART = 0.1    # the share of positions that may lie outside bf16's typical rounding


def tokens_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


@pytest.fixture(scope="module", params=["mixtral", "qwen3-moe", "deepseek-v3"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Our bf16 runner on a bf16 checkpoint; transformers' model in bf16, and in float64 on the same bf16 weights."""
    folder = tmp_path_factory.mktemp(f"bf16-{request.param}")
    model = tiny_deepseek_v3(folder, 48) if request.param == "deepseek-v3" else tiny_moe(request.param, folder)
    model16 = model.to(torch.bfloat16).eval()
    model16.save_pretrained(folder)
    runner = ModelRunner(folder, dtype=torch.bfloat16, device="cpu", num_blocks=64, block_size=BLOCK)
    return runner, model16, float64_twin(model16)


def per_position_deviation(logits: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    return (logits.double() - exact).abs().max(dim=-1).values


def our_logits(runner: ModelRunner, tokens: list[int], table: tuple[int, ...]) -> torch.Tensor:
    """[len(tokens), vocab]: the last logits of a whole prefill, of uneven chunks over the cached KV, then of every
    token decoded one by one (each logit row at the position it predicts from)."""
    rows = {}
    chunk_ends = [0, 9, 14]
    for start, end in itertools.pairwise(chunk_ends):
        rows[end - 1] = runner.execute(ForwardBatch((SeqChunk(tuple(tokens[start:end]), start, table),)))[0]
    for pos in range(chunk_ends[-1], len(tokens)):
        rows[pos] = runner.execute(ForwardBatch((SeqChunk((tokens[pos],), pos, table),)))[0]
    whole = runner.execute(ForwardBatch((SeqChunk(tuple(tokens), 0, table[::-1]),)))[0]
    assert (whole.double() - rows[len(tokens) - 1].double()).abs().max() < 1.0   # the same position, another path
    return torch.stack([rows[p] for p in sorted(rows)]), sorted(rows)


def test_bf16_logits_lie_within_bf16_rounding_of_float64(tiny) -> None:
    runner, model16, model64 = tiny
    ours, theirs = [], []
    for seed in (1, 2, 3):
        tokens = tokens_of(40, seed)
        with torch.inference_mode():
            exact = model64(torch.tensor([tokens])).logits[0]
            transformers_bf16 = model16(torch.tensor([tokens])).logits[0]
        table = tuple(random.Random(seed).sample(range(runner.num_blocks), 10))   # shuffled blocks
        logits, positions = our_logits(runner, tokens, table)
        ours.append(per_position_deviation(logits, exact[positions]))
        theirs.append(per_position_deviation(transformers_bf16[positions], exact[positions]))
    ours_all, theirs_all = torch.cat(ours), torch.cat(theirs)
    tolerance = TOLERANCE_MULTIPLE * theirs_all.median().item()
    assert tolerance > 0.0
    apart = (ours_all > tolerance).float().mean().item()
    assert apart <= MAX_ROUTED_APART, (apart, tolerance, ours_all.tolist())
    assert ours_all.median().item() <= 2 * theirs_all.median().item(), (ours_all.median(), theirs_all.median())
