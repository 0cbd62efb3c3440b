"""The workers on a GPU, every figure beside its baseline from the same run (not a test; needs CUDA).

    python benchmarks/gpu_bench.py [--sections bandwidth,models,disagg,decoder] [--models smollm2,llama8b]
        [--variants torch,fused,fused+split] [--no-eager] [--no-generate]

- bandwidth: a device-to-device copy (bytes read + written per second): the floor's denominator.
- models: the bundled SmolLM2 (its weights; `smollm2-shape`: random weights in its shape, where the model
  package is not installed) and a Llama-3-8B-shaped model (random bf16 weights: a decode step reads the
  same bytes whatever they hold), both in bf16 through the engine in this process, with each of
  `--variants`' kernels in turn (torch ops; the fused Triton layer kernels; those and split decode attention):
  - single-stream inter-token latency p50/p90, with CUDA graphs and eagerly, against the memory-bandwidth
    floor (weight and KV bytes read per token / the copy bandwidth above);
  - output tokens/s at concurrency 1, 8 and 64 (prefill included) against transformers' `generate` at
    batch 1 on the same GPU, same prompt length and output length.
- decoder: the Triton weight decoder (SmolLM2's layers compressed in bf16) in GB/s of output, against
  a copy of the same bytes within GPU memory.
- disagg: decode streams' ITL p50/p90 while long prompts arrive, one `both` worker process against a
  prefill and a decode worker process on the same GPU (KV moved through pinned host memory).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from backends.core.batch import ForwardBatch, SeqChunk  # noqa: E402
from backends.core.engine_config import EngineConfig  # noqa: E402
from backends.core.sampling_params import SamplingParams  # noqa: E402
from backends.engine.engine import LLMEngine  # noqa: E402
from backends.worker.loader import resolve_model  # noqa: E402
from backends.worker.model_runner import ModelRunner  # noqa: E402
from benchmarks.gpu_disagg import pct  # noqa: E402

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
             "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
             "max_position_embeddings": 8192, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
# SmolLM2-135M's shape, for a machine without the model package (random weights: the same bytes per step)
SMOLLM2_SHAPE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
                 "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                 "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
                 "max_position_embeddings": 8192, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
SHAPES = {"llama8b": LLAMA3_8B, "smollm2-shape": SMOLLM2_SHAPE}
# --variants: which CUDA kernels the decoder runs (backends/models/kernels/triton_ops.py, the attention's splits)
VARIANTS = {"torch": (False, False), "fused": (True, False), "fused+split": (True, True)}
CONCURRENCY = (1, 8, 64)
DEVICE = "cuda"   # a dry run of the model section on the CPU sets "cpu"


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def cuda_time(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of `fn` on the GPU (CUDA events), after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def bandwidth() -> float:
    """Bytes per second of a 4 GiB device-to-device copy, counting bytes read and written."""
    src = torch.empty(2**31, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    seconds = cuda_time(lambda: dst.copy_(src), 20)
    return 2 * 2**32 / seconds


# --- models ---------------------------------------------------------------------------------------

def model_folder(name: str, work: Path) -> tuple[Path, bool]:
    """(folder, random weights)."""
    if name == "smollm2":
        return resolve_model("smollm2"), False
    folder = work / name
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(SHAPES[name]))
    return folder, True


def use_variant(name: str) -> None:
    """Point the decoder at a variant's kernels; read when graphs are captured, so set before a runner is built."""
    from backends.attention import triton_decode
    from backends.models.kernels import triton_ops

    triton_ops.ENABLED, triton_decode.SPLIT = VARIANTS[name]


def bytes_per_token(runner: ModelRunner, context: float) -> float:
    """Weight bytes a decode step reads (every matrix once; of the input embedding, one row) plus the KV of
    `context` tokens."""
    model = runner.model
    unique = {id(p): p for p in model.parameters()}
    weights = sum(p.numel() * p.element_size() for p in unique.values())
    if model.lm_head.weight is not model.embed_tokens.weight:   # untied: the input table is not read whole
        weights -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    spec = runner.kv_cache.spec
    kv_per_token = spec.bytes_per_block / spec.block_size
    return weights + kv_per_token * context


def run_requests(engine: LLMEngine, n: int, prompt_len: int, max_tokens: int,
                 seed: int) -> tuple[int, float, list[float]]:
    """(tokens out, seconds, gaps between steps that produced tokens) for n requests sent together."""
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(n):
        prompt = torch.randint(0, engine.vocab_size, (prompt_len,), generator=gen).tolist()
        engine.add_request(f"{seed}-{i}", prompt, params)
    produced, gaps, last = 0, [], None
    start = time.perf_counter()
    while engine.has_unfinished():
        tokens = sum(len(o.new_token_ids) for o in engine.step())
        now = time.perf_counter()
        if tokens:
            produced += tokens
            if last is not None:
                gaps.append(now - last)
            last = now
    return produced, time.perf_counter() - start, gaps


def runner_step_seconds(runner: ModelRunner, context: int, repeats: int = 50) -> float:
    """Median wall seconds of one decode step of one sequence through the runner alone (no scheduler, no
    sampler), synchronised. Run after the engine is done: it writes KV into blocks 0.. of the cache."""
    table = tuple(range(-(-(context + 1) // runner.block_size)))
    batch = ForwardBatch((SeqChunk((5,), context, table),))
    times = []
    for i in range(repeats + 3):
        start = time.perf_counter()
        runner.execute(batch)
        synchronize()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def transformers_generate(folder: Path, random: bool, prompt_len: int, max_tokens: int) -> float:
    """transformers' greedy `generate` at batch 1 on the GPU, bf16: output tokens/s, prefill included."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if random:
        torch.set_default_dtype(torch.bfloat16)
        with torch.device(DEVICE):
            model = LlamaForCausalLM(LlamaConfig(**json.loads((folder / "config.json").read_text()))).eval()
        torch.set_default_dtype(torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).to(DEVICE).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), device=DEVICE)
    kwargs = {"do_sample": False, "max_new_tokens": max_tokens, "min_new_tokens": max_tokens, "pad_token_id": 0}
    with torch.inference_mode():
        model.generate(prompt, **{**kwargs, "max_new_tokens": 8, "min_new_tokens": 8})
        synchronize()
        start = time.perf_counter()
        model.generate(prompt, **kwargs)
        synchronize()
        seconds = time.perf_counter() - start
    del model
    return max_tokens / seconds


def bench_model(name: str, work: Path, bw: float, prompt_len: int, max_tokens: int, variant: str,
                eager: bool, generate: bool) -> None:
    use_variant(variant)
    folder, random = model_folder(name, work)
    num_blocks = 64 * -(-(prompt_len + max_tokens) // 16) * 2 + 64
    runner = ModelRunner(folder, dtype=torch.bfloat16, device=DEVICE, num_blocks=num_blocks, cuda_graph_max_batch=64,
                         random_weights=random)
    engine = LLMEngine(EngineConfig(model_dir=str(folder), device=DEVICE, dtype="bfloat16", num_blocks=num_blocks,
                                    max_num_seqs=64, max_num_batched_tokens=4096), runner=runner, model_dir=folder)
    graphs = runner.decode_graphs
    run_requests(engine, 2, prompt_len, 16, seed=999)   # warm-up
    floor = bytes_per_token(runner, prompt_len + max_tokens / 2) / bw
    print(f"\n## {name} ({'random' if random else 'real'} bf16 weights), prompt {prompt_len}, output {max_tokens}, "
          f"kernels: {variant}")
    print(f"bandwidth floor per token: {floor * 1e3:.3f} ms ({bytes_per_token(runner, 0) / 1e9:.3f} GB of weights)")
    print("| decode | ITL p50 ms | ITL p90 ms | p50 / floor |\n|---|---|---|---|")
    for label, mode in (("CUDA graphs", graphs), ("eager", None))[:2 if eager else 1]:
        runner.decode_graphs = mode
        _, _, gaps = run_requests(engine, 1, prompt_len, max_tokens, seed=1)
        print(f"| {label} | {pct(gaps, 50) * 1e3:.3f} | {pct(gaps, 90) * 1e3:.3f} | {pct(gaps, 50) / floor:.2f} |")
    runner.decode_graphs = graphs
    for c in CONCURRENCY:   # every shape these runs meet, once untimed (cuBLAS plans, Triton compiles)
        run_requests(engine, c, prompt_len, 4, seed=500 + c)
    rates = {}
    for c in CONCURRENCY:
        produced, seconds, _ = run_requests(engine, c, prompt_len, max_tokens, seed=10 + c)
        assert produced == c * max_tokens, produced
        rates[c] = produced / seconds
    step = runner_step_seconds(runner, prompt_len)
    print(f"\nthe runner alone, one sequence at context {prompt_len} (pack inputs, replay, copy logits out): "
          f"{step * 1e3:.3f} ms = {step / floor:.2f}x the floor; the engine's own work per step is the rest of the ITL")
    engine.close()
    del engine, runner
    free_memory()
    if not generate:
        print("| concurrency | output tok/s |\n|---|---|")
        for c, rate in rates.items():
            print(f"| {c} | {rate:.0f} |")
        return
    baseline = transformers_generate(folder, random, prompt_len, max_tokens)
    free_memory()
    print(f"\ntransformers generate, batch 1: {baseline:.1f} tok/s (the baseline)")
    print("| concurrency | output tok/s | x generate batch 1 |\n|---|---|---|")
    for c, rate in rates.items():
        print(f"| {c} | {rate:.0f} | {rate / baseline:.1f} |")


# --- weight decoder -------------------------------------------------------------------------------

def bench_decoder(work: Path) -> None:
    from backends.compression import compress_folder
    from backends.compression.compress import CastDtype
    from backends.compression.resident import CompressedTensor, load_compressed_resident

    out = work / "smollm2-compressed"
    compress_folder(resolve_model("smollm2"), out, cast=CastDtype.BF16)
    items = [item for file in sorted(out.glob("*.safetensors"))
             for item in load_compressed_resident(file, "cuda").values() if isinstance(item, CompressedTensor)]
    outs = [torch.empty(item.shape, dtype=item.dtype, device="cuda") for item in items]
    total = sum(o.numel() * o.element_size() for o in outs)
    compressed = sum(item.compressed_bytes for item in items)

    def decode() -> None:
        for item, dst in zip(items, outs, strict=True):
            item.decompress(dst)
    src = torch.cat([o.reshape(-1) for o in outs])
    dst = torch.empty_like(src)
    decode_s = cuda_time(decode, 20)
    copy_s = cuda_time(lambda: dst.copy_(src), 20)
    print(f"\n## Triton weight decoder: SmolLM2 in bf16, {len(items)} tensors, {total / 1e6:.0f} MB out "
          f"({compressed / total:.1%} compressed)")
    print("| | GB/s of output | ms |\n|---|---|---|")
    print(f"| decode (Triton) | {total / decode_s / 1e9:.0f} | {decode_s * 1e3:.3f} |")
    print(f"| copy within GPU memory (the baseline) | {total / copy_s / 1e9:.0f} | {copy_s * 1e3:.3f} |")


# --- disaggregated vs unified processes -----------------------------------------------------------

def bench_disagg(work: Path, streams: int, stream_tokens: int, long_tokens: int, long_every_s: float) -> None:
    from benchmarks.gpu_disagg import run_disagg
    asyncio.run(run_disagg(work, streams, stream_tokens, long_tokens, long_every_s))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", default="bandwidth,models,disagg,decoder")
    p.add_argument("--models", default="smollm2,llama8b")
    p.add_argument("--variants", default="fused+split",
                   help=f"kernels to run the models with, each in turn: {', '.join(VARIANTS)} (the default: today's)")
    p.add_argument("--no-eager", action="store_true", help="models: skip the eager ITL")
    p.add_argument("--no-generate", action="store_true", help="models: skip transformers' generate")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--streams", type=int, default=8, help="disagg: decode streams")
    p.add_argument("--stream-tokens", type=int, default=256, help="disagg: each stream's output")
    p.add_argument("--long-prompt-tokens", type=int, default=6000, help="disagg: interfering prompts' length")
    p.add_argument("--long-every-s", type=float, default=0.05, help="disagg: a long prompt this often")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    sections = set(args.sections.split(","))
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}")
    work = Path(tempfile.mkdtemp(prefix="switchyard-gpu-bench-"))
    bw = bandwidth()
    if "bandwidth" in sections:
        print(f"device-to-device copy: {bw / 1e12:.2f} TB/s (bytes read + written)")
    if "models" in sections:
        for name in args.models.split(","):
            for variant in args.variants.split(","):
                bench_model(name, work, bw, args.prompt_tokens, args.output_tokens, variant,
                            not args.no_eager, not args.no_generate)
    if "disagg" in sections:
        bench_disagg(work, args.streams, args.stream_tokens, args.long_prompt_tokens, args.long_every_s)
    if "decoder" in sections:
        bench_decoder(work)


if __name__ == "__main__":
    main()
