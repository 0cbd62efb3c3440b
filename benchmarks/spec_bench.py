"""Speculative decoding against plain decoding, in one run: output tokens/s and acceptance per proposer.

Workloads: (a) repetitive or structured (rewrite a JSON with one field changed, refactor code, quote a
passage, emit a tool-call JSON) and (b) unique prose; greedy, chat template, at concurrency 1 (the
prompts one after another) and 8 (all at once). Each configuration runs the same engine code on one
shared model runner; rounds interleave the configurations and the table gives medians, with the
plain engine ("none") as the baseline of the same run: "vs none" is the median over rounds of each
round's ratio to plain decoding in that round.

    .venv/bin/python benchmarks/spec_bench.py [--rounds 3] [--max-tokens 128] [--threads 2] [--dtype bfloat16]
        [--draft-dir DIR] [--eagle-dir DIR] [--proposers none,ngram,draft,eagle,ngram+eagle]

`ngram+eagle` and `ngram+draft` draft by prompt lookup where it matches and with the model elsewhere.
A proposer may name its own K: `--proposers none,ngram,ngram:8` compares K = --k with K = 8 in one run;
n-gram also its shortest n-gram: `ngram:8:1` is K = 8 matching down to single tokens (else `--ngram-min`).
An EAGLE head runs in int8 on this CPU; `eagle-f32` (or `ngram+eagle-f32`) runs it in the target's dtype (float32
unless `--dtype bfloat16`) beside it.

--draft-dir: a folder from `switchyard make-draft` (default $SWITCHYARD_CACHE/drafts/<model>-draft);
--eagle-dir: a head from `switchyard train-draft` (default: where it saves, $SWITCHYARD_CACHE/eagle/<model>-head).
A proposer without its folder is left out, with the command that builds it.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

STRUCTURED = [
    'Rewrite this JSON with "age" set to 31. Output only the JSON.\n{"name": "Alice Smith", "age": 30, '
    '"email": "alice@example.com", "address": {"street": "12 Oak Lane", "city": "Springfield", "zip": "12345"}, '
    '"tags": ["admin", "editor", "viewer"]}',
    'Change "status" to "shipped" and output the whole JSON only:\n{"order_id": 8841, "status": "pending", '
    '"items": [{"sku": "A-100", "qty": 2, "price": 9.99}, {"sku": "B-220", "qty": 1, "price": 24.5}], '
    '"customer": {"id": 301, "name": "Bob Lee"}}',
    "Refactor this function to use a list comprehension. Output only the code.\n"
    "def squares_of_evens(numbers):\n    result = []\n    for n in numbers:\n        if n % 2 == 0:\n"
    "            result.append(n * n)\n    return result\n",
    "Rename the variable `tmp` to `total` everywhere. Output only the code.\n"
    "def sum_prices(items):\n    tmp = 0\n    for item in items:\n        tmp += item.price * item.quantity\n"
    "    return tmp\n",
    "Answer by quoting the passage exactly. Passage: The mitochondria is the powerhouse of the cell. It "
    "produces energy in the form of ATP through cellular respiration, which takes place in its inner "
    "membrane.\nQuestion: What does the passage say about the mitochondria?",
    "Quote the first two sentences of this text word for word: Rivers carry water from the mountains to "
    "the sea. Along the way they shape valleys and feed forests. Cities grow along their banks.",
    'Emit a tool call as JSON: {"name": "get_weather", "arguments": {"city": ..., "unit": ...}} to get the '
    "weather in Paris in celsius. Output only the JSON.",
    'Call the tool search_flights as JSON {"name": "search_flights", "arguments": {"from": ..., "to": ..., '
    '"date": ...}} for a flight from Boston to Denver on 2026-12-01. Output only the JSON.',
]
PROSE = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "Describe your ideal weekend in the mountains.",
    "What are the pros and cons of working from home? Answer in prose.",
    "Write a poem about autumn leaves.",
    "Give advice to someone starting their first job.",
    "Describe the taste of a fresh strawberry to someone who has never had one.",
    "Tell me about the history of the bicycle.",
]


@dataclass
class Result:
    tokens: int
    seconds: float
    proposed: int
    accepted: int
    verifications: int


def default_dir(kind: str, model_dir: Path) -> Path:
    """Where `switchyard train-draft` puts its head, and where to keep a `make-draft` folder."""
    from backends.core.paths import default_cache_dir
    from tools.draft_training.train_draft import default_head_dir

    if kind == "eagle":
        return default_head_dir(model_dir)
    return default_cache_dir() / "drafts" / f"{model_dir.name}-draft"


def run_once(runner, model_dir: Path, prompts: list[list[int]], config, concurrency: int, max_tokens: int) -> Result:
    from backends.core.sampling_params import SamplingParams
    from backends.engine.engine import LLMEngine

    engine = LLMEngine(config, runner=runner, model_dir=model_dir)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    produced = 0
    start = time.perf_counter()
    for first in range(0, len(prompts), concurrency):
        for i, p in enumerate(prompts[first:first + concurrency]):
            engine.add_request(f"r{first + i}", p, params)
        while engine.has_unfinished():
            produced += sum(len(o.new_token_ids) for o in engine.step())
    seconds = time.perf_counter() - start
    s = engine.stats()
    return Result(produced, seconds, s.num_spec_proposed_tokens, s.num_spec_accepted_tokens, s.num_spec_verifications)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the target's (and a model proposer's) dtype; a worker's --dtype auto picks bfloat16 on CPUs "
                         "with AVX512-BF16 or AMX")
    ap.add_argument("--k", type=int, default=5, help="--num-speculative-tokens")
    ap.add_argument("--ngram-min", type=int, default=None, help="--ngram-min (default: the worker's)")
    ap.add_argument("--draft-dir", type=Path, default=None)
    ap.add_argument("--eagle-dir", type=Path, default=None)
    ap.add_argument("--proposers", default="none,ngram,draft,eagle,ngram+eagle")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per workload (at most 8)")
    return ap.parse_args()


def engine_configs(args: argparse.Namespace, model_dir: Path) -> dict:
    """An EngineConfig per --proposers entry, by name; a model proposer whose folder is missing is left out."""
    from backends.core.engine_config import EngineConfig

    dirs = {"draft": args.draft_dir or default_dir("draft", model_dir),
            "eagle": args.eagle_dir or default_dir("eagle", model_dir)}
    configs: dict[str, EngineConfig] = {}
    for name in args.proposers.split(","):
        spec, keep_dtype = name.removesuffix("-f32"), name.endswith("-f32")   # "eagle-f32": the head not in int8
        kind, _, rest = spec.partition(":")   # "ngram:8": this proposer at K = 8 (else --k)
        k, _, ngram_min = rest.partition(":")  # "ngram:8:1": and n-grams down to 1 (else --ngram-min)
        model = kind.rpartition("+")[2]         # "ngram+eagle": prompt lookup first, the head elsewhere
        if model in dirs and not dirs[model].exists():
            print(f"# {kind}: no folder at {dirs[model]} (build it: switchyard "
                  f"{'make-draft' if model == 'draft' else 'train-draft'}); left out")
            continue
        configs[name] = EngineConfig(
            model_dir=str(model_dir), dtype=args.dtype, num_blocks=512, max_num_seqs=16,
            speculative=None if kind == "none" else kind, num_speculative_tokens=int(k or args.k),
            speculative_model=str(dirs[model]) if model in dirs else None,
            spec_int8=not keep_dtype,
            **({"ngram_min": int(ngram_min or args.ngram_min)} if ngram_min or args.ngram_min else {}))
    return configs


def print_report(args: argparse.Namespace, workloads: dict[str, list[list[int]]], levels: list[int],
                 configs: dict, results: dict[tuple[str, int, str], list[Result]]) -> None:
    import platform
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    print(f"\nmachine: {cpu}, {args.threads} threads; SmolLM2-135M {args.dtype}; greedy; {args.max_tokens} tokens max; "
          f"K={args.k}; {args.rounds} rounds, medians; baseline: 'none' (plain decoding), same run; 'vs none': the "
          f"median of each round's ratio to plain decoding in that round")
    print(f"{'workload':<16} {'conc':>4} {'proposer':<11} {'out tok/s':>10} {'vs none':>8} {'accept len':>10} "
          f"{'accept rate':>11}")
    for workload in workloads:
        for conc in levels:
            base = results.get((workload, conc, "none"))
            for name in configs:
                rs = results[(workload, conc, name)]
                tps = statistics.median(x.tokens / x.seconds for x in rs)
                # paired by round: a round runs one workload's configurations back to back, so a shared
                # machine's drift from round to round cancels
                paired = statistics.median(x.tokens / x.seconds / (b.tokens / b.seconds)
                                           for x, b in zip(rs, base, strict=True)) if base else None
                ver = sum(x.verifications for x in rs)
                acc_len = (sum(x.accepted for x in rs) / ver + 1) if ver else float("nan")
                rate = sum(x.accepted for x in rs) / max(1, sum(x.proposed for x in rs))
                ratio = f"{paired:.2f}x" if paired is not None else "-"
                print(f"{workload:<16} {conc:>4} {name:<11} {tps:>10.1f} {ratio:>8} {acc_len:>10.2f} {rate:>11.2f}")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from backends.worker.loader import resolve_model
    from backends.worker.model_runner import ModelRunner
    from tools.draft_training.train_texts import chat_prompt_ids

    model_dir = resolve_model("smollm2")
    tok = AutoTokenizer.from_pretrained(str(model_dir))

    workloads = {"(a) structured": [chat_prompt_ids(tok, t) for t in STRUCTURED[:args.prompts]],
                 "(b) prose": [chat_prompt_ids(tok, t) for t in PROSE[:args.prompts]]}
    runner = ModelRunner(model_dir, dtype=getattr(torch, args.dtype), device="cpu", num_blocks=512, block_size=16)
    configs = engine_configs(args, model_dir)
    levels = [int(c) for c in args.concurrency.split(",")]
    results: dict[tuple[str, int, str], list[Result]] = {}
    for r in range(args.rounds):
        for workload, prompts in workloads.items():
            for conc in levels:
                names = list(configs) if r % 2 == 0 else list(reversed(configs))   # interleaved order
                for name in names:
                    res = run_once(runner, model_dir, prompts, configs[name], conc, args.max_tokens)
                    results.setdefault((workload, conc, name), []).append(res)
                    print(f"# round {r}: {workload} c={conc} {name}: {res.tokens / res.seconds:.1f} tok/s", flush=True)
    print_report(args, workloads, levels, configs, results)

if __name__ == "__main__":
    main()
