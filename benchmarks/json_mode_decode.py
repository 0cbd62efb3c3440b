"""What JSON mode costs a decode step: one closed batch of chat prompts decoded greedily by the engine with
`json_object` against the same batch without it (the baseline), alternating, both without drafts. The JSON
answers may end before max_tokens; the plain ones run to it (ignore_eos), so the figure compared is time per
sampled token. Prints each round and the median ratio.

    .venv/bin/python benchmarks/json_mode_decode.py [--batch 4] [--max-tokens 96] [--rounds 4] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

ASKS = ["Describe a cat as JSON with its name and age.", "List three planets in JSON.",
        "Who are you? Answer in JSON.", "Give a JSON object of three fruits and their colours.",
        "Return the capital of France as JSON.", "JSON for a dog with its breed.",
        "A JSON object with keys a, b and c.", "Describe a car in JSON."]


def run(runner: object, model_dir: Path, prompts: list[list[int]], json_object: bool,
        max_tokens: int) -> tuple[float, int, int]:
    """(ms per sampled token, tokens sampled, steps)."""
    from backends.core.engine_config import EngineConfig
    from backends.core.sampling_params import SamplingParams
    from backends.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), block_size=16, num_blocks=512),
                       runner=runner, model_dir=model_dir)   # type: ignore[arg-type]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, json_object=json_object,
                            ignore_eos=not json_object, speculative=False)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    if json_object:   # the masks' one-off build is not a step's cost
        engine.json_output.allowed(engine.scheduler.get("r0"))  # type: ignore[arg-type]
    tokens = steps = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    return 1000 * (time.perf_counter() - start) / tokens, tokens, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from backends.worker.loader import resolve_model
    from backends.worker.model_runner import ModelRunner
    from tools.draft_training.train_texts import chat_prompt_ids

    model_dir = resolve_model("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [chat_prompt_ids(tokenizer, ASKS[i % len(ASKS)]) for i in range(args.batch)]
    runner = ModelRunner(model_dir, dtype=torch.float32, device="cpu", num_blocks=512, block_size=16)
    print(f"{args.batch} chat prompts at once, greedy, up to {args.max_tokens} tokens, no drafts; "
          f"baseline: the same batch without JSON mode, alternating")
    print("| round | plain ms/token | JSON ms/token | ratio | JSON tokens | JSON steps |")
    print("|---|---|---|---|---|---|")
    ratios = []
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        got = {flag: run(runner, model_dir, prompts, flag, args.max_tokens) for flag in order}
        (plain, _, _), (json_ms, json_tokens, json_steps) = got[False], got[True]
        ratios.append(json_ms / plain)
        print(f"| {r} | {plain:.2f} | {json_ms:.2f} | {ratios[-1]:.3f} | {json_tokens} | {json_steps} |")
    print(f"median ratio (JSON / plain, per sampled token): {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
