"""Time the model runner alone: decode steps of 1 and N sequences at a given context, and a prefill.

    python -m tools.bench_runner [--model smollm2] [--threads 2] [--context 300] [--batch 32] [--baseline]
Reports the median of `--steps` timed steps after warm-up; no scheduler, sampler or server involved.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from backends.core.batch import ForwardBatch, SeqChunk
from backends.worker.loader import resolve_model
from backends.worker.model_runner import ModelRunner


def _time_steps(runner: ModelRunner, make_batch, steps: int) -> tuple[float, float]:
    """Median wall and process-CPU seconds of `steps` executions, after two warm-up runs.

    CPU time is reported beside wall time because a shared machine's other load inflates wall time.
    """
    walls, cpus = [], []
    for step in range(steps + 2):
        batch = make_batch(step)
        wall, cpu = time.perf_counter(), time.process_time()
        runner.execute(batch)
        if step >= 2:
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def bench_decode(runner: ModelRunner, num_seqs: int, context: int, steps: int) -> tuple[float, float]:
    """Median seconds of one decode step of `num_seqs` sequences of `context` cached tokens."""
    bs = runner.block_size
    blocks_per_seq = -(-(context + steps + 3) // bs)
    if num_seqs * blocks_per_seq > runner.num_blocks:
        raise ValueError("KV cache too small for this benchmark")
    tables = [tuple(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(num_seqs)]
    gen = torch.Generator().manual_seed(0)
    for table in tables:  # fill the context once (prefill), so attention reads real KV
        prompt = torch.randint(0, runner.vocab_size, (context,), generator=gen).tolist()
        runner.execute(ForwardBatch((SeqChunk(tuple(prompt), 0, table),)))

    def make_batch(step: int) -> ForwardBatch:
        return ForwardBatch(tuple(SeqChunk((100 + step,), context + step, table) for table in tables))
    return _time_steps(runner, make_batch, steps)


def bench_prefill(runner: ModelRunner, num_tokens: int, steps: int) -> tuple[float, float]:
    table = tuple(range(-(-num_tokens // runner.block_size)))
    prompt = tuple(torch.randint(0, runner.vocab_size, (num_tokens,)).tolist())
    return _time_steps(runner, lambda step: ForwardBatch((SeqChunk(prompt, 0, table),)), steps)


def bench_transformers_generate(model_dir: Path, context: int, new_tokens: int) -> float:
    """Baseline: transformers' batch-1 greedy `generate` tokens/s after a `context`-token prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, context))
    kwargs = dict(do_sample=False, min_new_tokens=new_tokens, max_new_tokens=new_tokens, pad_token_id=0)
    with torch.inference_mode():
        model.generate(prompt, **{**kwargs, "min_new_tokens": 4, "max_new_tokens": 4})  # warm-up
        start = time.perf_counter()
        model.generate(prompt, **kwargs)
        elapsed = time.perf_counter() - start
        start = time.perf_counter()
        model(prompt)  # prefill alone, subtracted so the figure is decode speed
        elapsed -= time.perf_counter() - start
    return new_tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--attention", default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--baseline", action="store_true", help="also time transformers' batch-1 generate")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    if args.baseline:
        tok_s = bench_transformers_generate(model_dir, args.context, args.steps * 2)
        print(f"transformers generate, batch 1 x {args.context} ctx: {tok_s:6.1f} tok/s")
    runner = ModelRunner(model_dir, dtype=getattr(torch, args.dtype), device=args.device, num_blocks=None,
                         attention_backend=args.attention)
    for num_seqs in (1, args.batch):
        wall, cpu = bench_decode(runner, num_seqs, args.context, args.steps)
        print(f"decode step, {num_seqs:3d} seqs x {args.context} ctx: {wall * 1e3:7.1f} ms wall "
              f"({num_seqs / wall:6.1f} tok/s), {cpu * 1e3:7.1f} ms CPU")
    wall, cpu = bench_prefill(runner, 512, max(3, args.steps // 4))
    print(f"prefill 512 tokens: {wall * 1e3:7.1f} ms wall ({512 / wall:6.1f} tok/s), {cpu * 1e3:7.1f} ms CPU")


if __name__ == "__main__":
    main()
