"""Step time of one rank against groups of ranks on this CPU (tensor-parallel, pipeline stages), in one run, with
the bytes each collective and each stage's sends move per step against the theory and each rank's memory (issue
48; docs/parallelism.md).

The checkpoint is transformers' own: a Llama of SmolLM2-135M's shape (hidden 576, MLP 1536, `--layers` layers,
vocabulary 49,152, tied embeddings) but with 8 query heads over 2 KV heads so that two ranks divide it, random
weights as transformers initialises them, saved in float32. Each case runs the same batches through the runner the
engine would hold (ModelRunner, or rank 0's GroupModelRunner over ranks it spawns, gloo): a prefill of
`--prompt-len` tokens, and decode steps of 1 and 8 sequences at that context; the median of `--steps` steps.
`--family qwen3-moe`: a Qwen3-MoE of the same width (16 experts of 384 columns, top-4), served by a
group twice, its experts split within each expert and, with expert parallelism, whole (`--enable-expert-parallel`).
`--family deepseek-v3`: DeepSeek-V3 of that width (latent attention with kv_lora_rank 128 and q_lora_rank 192 over
the 8 heads, a dense first layer, then 16 experts of 384 columns, top-4 in 2 of 4 groups, and a shared expert),
served by the same TP and EP groups (not PP: DeepSeek-V3 has no pipeline stages yet).
`--groups`: which groups of `--size` ranks run (TP, EP for the MoE families, PP: `--size` pipeline stages).
A script, not a test:

    .venv/bin/python benchmarks/tensor_parallel_bench.py [--layers 30] [--steps 20] [--family qwen3-moe|deepseek-v3]
        [--groups tp pp]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.core.batch import ForwardBatch, SeqChunk  # noqa: E402
from backends.core.engine_config import EngineConfig  # noqa: E402
from backends.executor.group_runner import GroupModelRunner  # noqa: E402
from backends.worker.model_runner import ModelRunner  # noqa: E402

BLOCK = 16
NUM_BLOCKS = 128


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--size", type=int, default=2, help="ranks of the group")
    p.add_argument("--family", choices=("llama", "qwen3-moe", "deepseek-v3"), default="llama")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads of the TP=1 runs")
    p.add_argument("--groups", nargs="+", choices=("tp", "ep", "pp"), default=["tp", "ep", "pp"],
                   help="groups to run (ep: the MoE families only; pp: not deepseek-v3)")
    return p.parse_args()


def build_checkpoint(family: str, layers: int, folder: Path) -> None:
    from transformers import AutoModelForCausalLM, DeepseekV3Config, LlamaConfig, Qwen3MoeConfig

    shape: dict[str, Any] = dict(vocab_size=49152, hidden_size=576, num_hidden_layers=layers,
                                 num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                                 tie_word_embeddings=True, rope_theta=100000.0)
    moe: dict[str, Any] = dict(intermediate_size=1536, moe_intermediate_size=384, num_experts_per_tok=4)
    config = {"llama": lambda: LlamaConfig(intermediate_size=1536, **shape),
              "qwen3-moe": lambda: Qwen3MoeConfig(num_experts=16, **moe, **shape),
              "deepseek-v3": lambda: DeepseekV3Config(
                  n_routed_experts=16, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
                  q_lora_rank=192, kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
                  **moe, **{**shape, "num_key_value_heads": 8})}[family]()
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)


def batches(prompt_len: int) -> dict[str, ForwardBatch]:
    blocks = -(-(prompt_len + 1) // BLOCK)
    table = lambda seq: tuple(range(seq * blocks, (seq + 1) * blocks))  # noqa: E731
    decode = lambda n: ForwardBatch(tuple(SeqChunk((7,), prompt_len, table(s)) for s in range(n)))  # noqa: E731
    return {f"prefill {prompt_len} tokens": ForwardBatch((SeqChunk(tuple(range(1, prompt_len + 1)), 0, table(0)),)),
            "decode, 1 sequence": decode(1), "decode, 8 sequences": decode(8)}


def time_steps(runner: Any, batch: ForwardBatch, steps: int) -> float:
    runner.execute(batch)   # warm
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        runner.execute(batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def run_case(label: str, runner: Any, args: argparse.Namespace, rows: list[list[str]]) -> torch.Tensor:
    """Times each batch into `rows`; returns the prefill's logits (held against one rank's)."""
    cases = batches(args.prompt_len)
    for name, batch in cases.items():
        rows.append([label, name, f"{time_steps(runner, batch, args.steps):.1f}"])
    return runner.execute(next(iter(cases.values()))).clone()


def collective_bytes(runner: GroupModelRunner, batch: ForwardBatch, layers: int, size: int, stages: int) -> list[str]:
    """Rank 0's traffic in one step of `batch` against the theory: with `size` tensor-parallel ranks, hidden x tokens
    x 4 bytes x (2 all-reduces per layer + the embedding's) and its vocabulary columns gathered; with `stages`,
    hidden x tokens x 4 bytes sent to stage 1."""
    counts, sends = runner.counts, runner.send_counts
    before = (counts.num_all_reduces, counts.all_reduce_bytes, counts.gather_bytes, sends.num_sends, sends.send_bytes)
    runner.execute(batch)
    after = (counts.num_all_reduces, counts.all_reduce_bytes, counts.gather_bytes, sends.num_sends, sends.send_bytes)
    tokens, rows = batch.num_tokens, len(batch.chunks)
    tp = size > 1
    theory = tokens * 576 * 4 * (2 * layers // stages + 1) if tp else 0
    gather_theory = rows * (-(-49152 // size)) * 4 if tp else 0
    send_theory = tokens * 576 * 4 if stages > 1 else 0
    kb = lambda i: f"{(after[i] - before[i]) / 1e3:.1f}"  # noqa: E731
    return [str(tokens), str(after[0] - before[0]), kb(1), f"{theory / 1e3:.1f}", kb(2), f"{gather_theory / 1e3:.1f}",
            str(after[3] - before[3]), kb(4), f"{send_theory / 1e3:.1f}"]


def main() -> None:
    args = parse_args()
    rows: list[list[str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_checkpoint(args.family, args.layers, folder)
        torch.set_num_threads(1)   # the groups first: rank 0's resident memory is then its own shard's
        traffic: list[list[str]] = []
        ranks: list[tuple[str, Any]] = []
        logits: dict[str, torch.Tensor] = {}   # each runner's prefill logits
        for kind in args.groups:
            if kind == "ep" and args.family == "llama":
                continue
            size, stages = (1, args.size) if kind == "pp" else (args.size, 1)
            config = EngineConfig(model_dir=str(folder), num_blocks=NUM_BLOCKS, block_size=BLOCK,
                                  torch_num_threads=1, tensor_parallel_size=size, pipeline_parallel_size=stages,
                                  enable_expert_parallel=kind == "ep")
            label = f"{kind.upper()}={args.size}"
            group = GroupModelRunner(config, folder)
            try:
                logits[label] = run_case(f"{label}, 1 thread per rank", group, args, rows)
                traffic += [[label, *collective_bytes(group, b, args.layers, size, stages)]
                            for b in batches(args.prompt_len).values()]
                ranks += [(label, ready) for ready in group.ranks]
            finally:
                group.close()
        for threads in args.threads:
            torch.set_num_threads(threads)
            single = ModelRunner(folder, dtype=torch.float32, device="cpu", num_blocks=NUM_BLOCKS, block_size=BLOCK)
            logits[f"TP=1, {threads} thread(s)"] = run_case(f"TP=1, {threads} thread(s)", single, args, rows)
            weights = single.weight_bytes()   # (its resident memory would hold the group's leftovers)
            del single
    one = logits.pop(f"TP=1, {args.threads[0]} thread(s)")
    for label, group_logits in logits.items():
        print(f"{label}: prefill logits at most {(group_logits - one).abs().max().item():.2e} from TP=1's "
              f"(largest |logit| {one.abs().max().item():.2f})")
    report(args, rows, traffic, ranks, weights)


def report(args: argparse.Namespace, rows: list[list[str]], traffic: list[list[str]], ranks: list[tuple[str, Any]],
           weights: int) -> None:
    print(f"{datetime.date.today()}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {args.family}, {args.layers} layers, float32, median of {args.steps} steps\n")
    print("| runner | step | ms |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print("\n| group | tokens | all-reduces | all-reduce kB (rank 0) | theory kB | gather kB (rank 0) | theory kB "
          "| sends | sent kB (rank 0) | theory kB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in traffic:
        print("| " + " | ".join(row) + " |")
    print(f"\nTP=1: weights {weights / 1e6:.1f} MB")
    print("\n| group | rank | weights MB | read from checkpoint MB | anonymous resident MB before / after its shard |")
    print("|---|---|---|---|---|")
    for label, ready in ranks:
        print(f"| {label} | {ready.rank} | {ready.weight_bytes / 1e6:.1f} | {ready.read_bytes / 1e6:.1f} | "
              f"{ready.rss_anon_before_bytes / 1e6:.1f} / {ready.rss_anon_bytes / 1e6:.1f} |")


if __name__ == "__main__":
    main()
