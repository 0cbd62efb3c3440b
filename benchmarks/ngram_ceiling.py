"""How far prompt lookup can cut decode steps on spec_bench's workloads, whatever its n-gram rule.

Greedy decoding is deterministic, so the steps a drafting rule needs can be counted without the engine:
transformers' own greedy `generate` gives each prompt's answer (the reference, not our engine), then each
rule is replayed over it. A step drafts up to K tokens from the prompt and the answer so far; the drafts
equal to the answer's next tokens are accepted, and the target's own token follows, as in a verification.

Rules:
- `latest n..m`: the tokens after the latest earlier occurrence of the last n tokens, trying n from the
  longest down (what backends/speculative/ngram.py does, with `--ngram-min m --ngram-max n`);
- `oracle n>=m`: every earlier occurrence of every suffix of length >= m, the one the answer follows
  furthest taken (what no proposer can know ahead; the ceiling of prompt lookup on these answers). It drafts
  only the tokens that will be accepted, so its rows per step are the least any rule needs for its steps.

Prints, per workload and rule, steps against plain decoding's one step per token and draft rows per step.
Tokens/s follows as fewer steps / (the cost of a verify step against a plain one): on the 2-core EPYC a
6-row verify costs about 1.03-1.05 of a plain step at batch 1 (docs/benchmarks.md).

    .venv/bin/python benchmarks/ngram_ceiling.py [--max-tokens 128] [--k 5 8] [--show-answers]
"""
from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Sequence

import torch

from spec_bench import PROSE, STRUCTURED

Rule = Callable[[Sequence[int], Sequence[int], int], list[int]]   # (context, answer ahead, K) -> drafts


def followers(context: Sequence[int], longest: int, shortest: int) -> Iterator[int]:
    """Where the tokens after each earlier occurrence of the context's last n tokens start, n from `longest`
    down to `shortest`, latest occurrence first for each n."""
    for n in range(longest, shortest - 1, -1):
        if len(context) <= n:
            continue
        suffix = list(context[-n:])
        for start in range(len(context) - n - 1, -1, -1):
            if list(context[start:start + n]) == suffix:
                yield start + n


def latest(longest: int, shortest: int) -> Rule:
    def rule(context: Sequence[int], ahead: Sequence[int], k: int) -> list[int]:
        follow = next(followers(context, longest, shortest), None)
        return [] if follow is None else list(context[follow:follow + k])
    return rule


def oracle(shortest: int, longest: int = 8) -> Rule:
    def rule(context: Sequence[int], ahead: Sequence[int], k: int) -> list[int]:
        best: list[int] = []
        for follow in followers(context, longest, shortest):
            drafts = list(context[follow:follow + k])
            run = accepted(drafts, ahead)
            if run > len(best):
                best = drafts[:run]
        return best
    return rule


def accepted(drafts: Sequence[int], ahead: Sequence[int]) -> int:
    run = 0
    while run < len(drafts) and run < len(ahead) and drafts[run] == ahead[run]:
        run += 1
    return run


def replay(rule: Rule, prompt: list[int], answer: list[int], k: int) -> tuple[int, int]:
    """(steps, draft rows) to produce `answer` with `rule`'s drafts at K = k."""
    pos = steps = rows = 0
    while pos < len(answer):
        drafts = rule(prompt + answer[:pos], answer[pos:], k)
        pos += accepted(drafts, answer[pos:]) + 1
        steps += 1
        rows += len(drafts)
    return steps, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, nargs="+", default=[5, 8])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--show-answers", action="store_true", help="print each prompt's greedy answer")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from backends.worker.loader import resolve_model
    from tools.draft_training.train_texts import chat_prompt_ids

    model_dir = resolve_model("smollm2")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    workloads: dict[str, list[tuple[list[int], list[int]]]] = {}
    for name, texts in (("(a) structured", STRUCTURED), ("(b) prose", PROSE)):
        pairs = []
        for text in texts:
            prompt = chat_prompt_ids(tok, text)
            with torch.inference_mode():
                out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=args.max_tokens)
            pairs.append((prompt, out[0, len(prompt):].tolist()))
            if args.show_answers:
                print(f"{name}: {tok.decode(pairs[-1][1])!r}")
        workloads[name] = pairs

    rules = {"latest 4..2 (default)": latest(4, 2), "latest 4..1": latest(4, 1),
             "oracle n>=2": oracle(2), "oracle n>=1": oracle(1)}
    print(f"greedy answers of transformers' generate, {args.max_tokens} tokens at most; steps of plain decoding: "
          "one per token")
    print(f"{'workload':<16} {'rule':<22} {'K':>3} {'tokens':>7} {'steps':>6} {'fewer steps':>12} {'rows/step':>10}")
    for name, pairs in workloads.items():
        for label, rule in rules.items():
            for k in args.k:
                tokens = sum(len(answer) for _, answer in pairs)
                steps = rows = 0
                for prompt, answer in pairs:
                    s, r = replay(rule, prompt, answer, k)
                    steps, rows = steps + s, rows + r
                print(f"{name:<16} {label:<22} {k:>3} {tokens:>7} {steps:>6} {tokens / steps:>11.2f}x "
                      f"{rows / steps:>10.2f}")


if __name__ == "__main__":
    main()
