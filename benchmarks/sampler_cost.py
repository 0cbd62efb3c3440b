"""What the sampler's per-step work costs: `sample()` on one step's logits for a batch, and the two pieces
added for logit_bias and for logits past float32's range, each against the same call without them, in the
same run. Prints a table of medians and ratios.

    python benchmarks/sampler_cost.py [--rows 32] [--vocab 49152] [--repeats 200] [--threads 2]

Rows:
- `temperature scaling`: `logits / temperature`, as `filtered_probs` did before the clamp (the baseline);
- `+ clamp to finite`: the same with the clamp `filtered_probs` now applies;
- `sample() greedy` / `+ logit_bias`: a greedy batch, then each row with 10 biased tokens;
- `sample() temperature 0.7, top_p 0.9`: the sampled path, with the clamp inside it.
Logits are random normal x 3 (peakier than a model's first-step logits, flatter than most later steps).
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from backends.core.sampling_params import SamplingParams
from backends.worker.sampler import SampleRow, sample


def median_us(fn: Callable[[], object], repeats: int) -> float:
    fn()   # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def rows(n: int, **params: object) -> list[SampleRow]:
    return [SampleRow(SamplingParams(**params), seed, (), (), (2,)) for seed in range(n)]  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=49152)   # SmolLM2's
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0)) * 3
    temperature = torch.full((args.rows, 1), 0.7)
    top = torch.finfo(logits.dtype).max
    bias = tuple((t, 5.0) for t in range(0, 10 * 997, 997))
    pairs = [
        ("temperature scaling", lambda: logits / temperature,
         "+ clamp to finite", lambda: (logits / temperature).clamp_(max=top)),
        ("sample() greedy", lambda: sample(logits, rows(args.rows, temperature=0.0)),
         "+ logit_bias (10 tokens a row)", lambda: sample(logits, rows(args.rows, temperature=0.0, logit_bias=bias))),
    ]
    print(f"{args.rows} rows x {args.vocab} tokens, {args.threads} threads, median of {args.repeats}")
    print(f"| {'what':<36} | {'µs':>9} | {'vs baseline':>11} |")
    print(f"|{'-' * 38}|{'-' * 11}|{'-' * 13}|")
    for base_name, base, new_name, new in pairs:
        base_us, new_us = median_us(base, args.repeats), median_us(new, args.repeats)
        print(f"| {base_name:<36} | {base_us:>9.1f} | {'(baseline)':>11} |")
        print(f"| {new_name:<36} | {new_us:>9.1f} | {new_us / base_us:>10.2f}x |")
    sampled_rows = rows(args.rows, temperature=0.7, top_p=0.9)
    sampled = median_us(lambda: sample(logits, sampled_rows), max(10, args.repeats // 10))
    print(f"| {'sample() temperature 0.7, top_p 0.9':<36} | {sampled:>9.1f} | {'':>11} |")


if __name__ == "__main__":
    main()
