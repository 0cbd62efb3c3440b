"""One closed batch of 8 prompts (spec_bench's), plain decoding against one proposer, round by round.

spec_bench's concurrency-8 figure is the median of a few rounds, and on a shared machine it moves by more
than the 5% that separates a proposer's cost from none. This script runs only that batch, alternating
plain and speculative runs (the order flips each round), and prints each round's ratio beside what the
engine did: steps, verifications, drafts proposed and accepted, passes of the proposer (of its model,
behind prompt lookup) and the time in them.
Those counts do not depend on the machine's load, so an A/B of two checkouts reads them first:

    .venv/bin/python benchmarks/spec_batch.py --workload prose --proposer eagle [--eagle-dir DIR] [--rounds 4]
    cd <other checkout> && PYTHONPATH=. <this checkout>/.venv/bin/python <this checkout>/benchmarks/spec_batch.py ...
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Run:
    tok_s: float
    steps: int
    ms_per_step: float
    propose_ms_per_step: float
    verifications: int
    proposed: int
    accepted: int
    passes: Counter[tuple[int, int]]


def run(runner, model_dir: Path, prompts: list[list[int]], spec: dict | None, max_tokens: int) -> Run:
    from backends.core.engine_config import EngineConfig
    from backends.core.sampling_params import SamplingParams
    from backends.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), block_size=16, num_blocks=512, **(spec or {})),
                       runner=runner, model_dir=model_dir)
    propose_seconds = [0.0]
    passes: Counter[tuple[int, int]] = Counter()
    if spec:
        drafting = getattr(engine.proposer, "model", engine.proposer)   # behind prompt lookup: its model
        propose, inner = engine._propose, drafting.propose

        def timed_propose() -> None:
            t = time.perf_counter()
            propose()
            propose_seconds[0] += time.perf_counter() - t

        def counted(requests):
            passes[(len(requests), max(r.num_tokens for r in requests))] += 1
            return inner(requests)

        engine._propose, drafting.propose = timed_propose, counted
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    tokens = steps = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    seconds = time.perf_counter() - start
    s = engine.stats()
    return Run(tokens / seconds, steps, 1000 * seconds / steps, 1000 * propose_seconds[0] / steps,
               s.num_spec_verifications, s.num_spec_proposed_tokens, s.num_spec_accepted_tokens, passes)


def main() -> None:
    from backends.core.engine_config import SPECULATIVE_PROPOSERS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=("prose", "structured"), default="prose")
    ap.add_argument("--proposer", choices=SPECULATIVE_PROPOSERS, default="eagle")
    ap.add_argument("--eagle-dir", type=Path, default=None)
    ap.add_argument("--draft-dir", type=Path, default=None)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-int8-drafts", action="store_true", help="an EAGLE head in float32 (default: int8)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from backends.worker.loader import resolve_model
    from backends.worker.model_runner import ModelRunner
    from spec_bench import PROSE, STRUCTURED, default_dir
    from tools.draft_training.train_texts import chat_prompt_ids

    model_dir = resolve_model("smollm2")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [chat_prompt_ids(tok, t) for t in (PROSE if args.workload == "prose" else STRUCTURED)]
    runner = ModelRunner(model_dir, dtype=torch.float32, device="cpu", num_blocks=512, block_size=16)
    spec: dict = {"speculative": args.proposer, "num_speculative_tokens": args.k, "spec_int8": not args.no_int8_drafts}
    model = args.proposer.rpartition("+")[2]
    if model != "ngram":
        folder = getattr(args, f"{model}_dir") or default_dir(model, model_dir)
        spec["speculative_model"] = str(folder)

    print(f"{args.workload}, 8 prompts at once, {args.max_tokens} tokens, {args.proposer} K={args.k}"
          f"{' float32' if args.no_int8_drafts else ''}; "
          f"baseline: plain decoding, alternating")
    print(f"{'round':>5} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} {'steps':>9} {'ms/step':>13} "
          f"{'propose ms':>10} {'verifs':>6} {'proposed':>8} {'accepted':>8} {'passes':>6}")
    ratios = []
    for r in range(args.rounds):
        if r % 2 == 0:
            plain = run(runner, model_dir, prompts, None, args.max_tokens)
            fast = run(runner, model_dir, prompts, spec, args.max_tokens)
        else:
            fast = run(runner, model_dir, prompts, spec, args.max_tokens)
            plain = run(runner, model_dir, prompts, None, args.max_tokens)
        ratios.append(fast.tok_s / plain.tok_s)
        print(f"{r:>5} {plain.tok_s:>11.1f} {fast.tok_s:>10.1f} {ratios[-1]:>6.3f} "
              f"{plain.steps:>4}/{fast.steps:<4} {plain.ms_per_step:>6.1f}/{fast.ms_per_step:<6.1f} "
              f"{fast.propose_ms_per_step:>10.2f} {fast.verifications:>6} {fast.proposed:>8} {fast.accepted:>8} "
              f"{sum(fast.passes.values()):>6}", flush=True)
    print(f"median ratio {statistics.median(ratios):.3f} over {args.rounds} rounds "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
