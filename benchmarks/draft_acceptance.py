"""Acceptance of self-speculative drafts cut from SmolLM2 by `switchyard make-draft`, all in one run.

  .venv/bin/python benchmarks/draft_acceptance.py [--layers 2,4,6,8,10] [--tails 0,1] [--k 4] [--tokens 64]

For each draft (the target's first N - tail layers and its last `tail` layers) it replays greedy
speculative decoding against the target's own greedy continuation of every prompt (computed first, by the
target drafting for itself through the same DraftModelProposer): each step the draft proposes K tokens
from the verified tokens, the longest prefix equal to the target's tokens is accepted, and the target's
next token follows. Two prompt sets, chat-formatted: (a) repetitive or structured (rewrite JSON with one
field changed, refactor code, quote a passage, emit a tool call), (b) unique prose.

Prints per draft: weight bytes per token and measured seconds per single-token forward, both relative
to the target's (the baseline, measured in the same run); mean accepted drafts per step and the
per-token acceptance rate on (a) and (b); and the speedup the engine's cost model
(backends/speculative/adaptive.py: a step costs 1 + K * (draft cost + verify cost) target steps) predicts at
a fixed K with the measured cost.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.core.batch import ForwardBatch, SeqChunk
from backends.speculative.draft import DraftModelProposer, weight_bytes_per_token
from backends.speculative.proposer import DraftRequest
from backends.worker.loader import resolve_model
from backends.worker.model_runner import ModelRunner
from tools.draft_training.make_draft import make_draft

VERIFY_COST = 0.06   # one more token in the target's forward, in decode steps (adaptive.py's default)

_PASSAGE = ("The harbour froze in the winter of 1894. Ships waited outside for six weeks, and the town ran "
            "short of coal. In February the council hired two hundred men to cut a channel through the ice. "
            "The channel opened on the ninth of March, and the first ship to enter carried flour and lamp oil.")
_CODE = ("def total_price(items):\n    t = 0\n    for i in range(len(items)):\n        item = items[i]\n"
         "        t = t + item['price'] * item['qty']\n    return t\n")
_TOOLS = ('[{"name": "get_weather", "parameters": {"city": "string", "unit": "celsius|fahrenheit"}}, '
          '{"name": "search_flights", "parameters": {"origin": "string", "destination": "string", '
          '"date": "YYYY-MM-DD"}}]')
STRUCTURED = [
    'Rewrite this JSON with "city" changed to "Lisbon". Output only the JSON.\n'
    '{"id": 4821, "name": "Maria Santos", "email": "maria.santos@example.com", "city": "Porto", '
    '"age": 34, "tags": ["customer", "newsletter"], "active": true}',
    f"Refactor this code to use a generator expression and sum(). Output only the code.\n{_CODE}",
    f"{_PASSAGE}\n\nAnswer by quoting the exact sentence from the passage: when did the channel open?",
    f"You can call these tools: {_TOOLS}\nReply with only a JSON tool call of the form "
    '{"name": ..., "arguments": {...}}.\nUser: what is the weather in Oslo in celsius?',
]
PROSE = [
    "Write a short story about a clockmaker who loses her sense of time.",
    "Describe what a morning at a mountain monastery might feel like.",
    "Explain in your own words why people enjoy walking in the rain.",
    "Write a letter from a retired sailor to his granddaughter about the sea.",
]


@dataclass(frozen=True, slots=True)
class Acceptance:
    mean_accepted: float   # drafts accepted per verification step
    rate: float            # accepted / drafts checked (a draft is checked when all before it were accepted)


def chat_prompts(model_dir: Path, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)) for t in texts]


def continuations(proposer: DraftModelProposer, prompts: list[list[int]], num_tokens: int,
                  eos: int) -> list[list[int]]:
    """Greedy continuations of every prompt up to EOS, batched (the target drafting for itself is greedy
    decoding; it runs on past EOS, the engine would not)."""
    out = proposer.propose([DraftRequest(f"ref{i}", p, num_tokens) for i, p in enumerate(prompts)])
    for i in range(len(prompts)):
        proposer.free(f"ref{i}")
    return [tokens[:tokens.index(eos) + 1] if eos in tokens else tokens for tokens in out]


def replay(proposer: DraftModelProposer, prompts: list[list[int]], refs: list[list[int]], k: int) -> Acceptance:
    """Speculative decoding against known target tokens, all prompts batched in each propose call."""
    num_out = [1] * len(prompts)   # the prefill's token is out before the first draft
    accepted = checked = steps = 0
    while live := [i for i in range(len(prompts)) if num_out[i] < len(refs[i])]:
        wanted = {i: min(k, len(refs[i]) - num_out[i]) for i in live}
        requests = [DraftRequest(str(i), [*prompts[i], *refs[i][:num_out[i]]], wanted[i]) for i in live]
        for i, drafts in zip(live, proposer.propose(requests), strict=True):
            target = refs[i][num_out[i]:num_out[i] + wanted[i]]
            n = next((j for j, (d, t) in enumerate(zip(drafts, target, strict=False)) if d != t),
                     min(len(drafts), len(target)))
            accepted += n
            checked += min(n + 1, len(drafts))
            steps += 1
            num_out[i] += n + 1
    for i in range(len(prompts)):
        proposer.free(str(i))
    return Acceptance(accepted / steps, accepted / max(checked, 1))


def decode_seconds(runners: list[ModelRunner], repeats: int) -> list[float]:
    """Median seconds of one single-token forward at position 128 (batch 1) of each runner, timed in
    turns so that a shared machine's load falls on all of them alike."""
    table = tuple(range(9))
    for runner in runners:
        runner.execute(ForwardBatch((SeqChunk(tuple(range(1, 129)), 0, table),)))
    times: list[list[float]] = [[] for _ in runners]
    for _ in range(repeats):
        for runner, samples in zip(runners, times, strict=True):
            start = time.perf_counter()
            runner.execute(ForwardBatch((SeqChunk((42,), 128, table),)))
            samples.append(time.perf_counter() - start)
    return [statistics.median(samples) for samples in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="2,4,6,8,10", help="draft sizes (decoder layers)")
    parser.add_argument("--tails", default="0,1", help="how many of them are the target's last layers")
    parser.add_argument("--k", type=int, default=4, help="drafts per step")
    parser.add_argument("--tokens", type=int, default=64, help="target tokens per prompt")
    parser.add_argument("--repeats", type=int, default=30, help="timed forwards per model")
    args = parser.parse_args()
    torch.manual_seed(0)
    target_dir = resolve_model("smollm2")
    sets = {"a": chat_prompts(target_dir, STRUCTURED), "b": chat_prompts(target_dir, PROSE)}
    # The target as its own proposer: its drafts are its greedy tokens (its cost_per_token is not used).
    target = DraftModelProposer(target_dir, target_bytes_per_token=1, dtype=torch.float32, device="cpu",
                                num_blocks=64)
    target_bytes = weight_bytes_per_token(target.runner.model, torch.float32)
    eos = int(target.runner.config.eos_token_id)
    refs = {name: continuations(target, prompts, args.tokens, eos) for name, prompts in sets.items()}
    target_s = decode_seconds([target.runner], args.repeats)[0]
    print(f"target: SmolLM2-135M float32, {target_bytes / 1e6:.0f} MB of weights per token, "
          f"{target_s * 1e3:.1f} ms per single-token forward; K={args.k}, {args.tokens} tokens per prompt, "
          f"{len(STRUCTURED)} prompts in (a), {len(PROSE)} in (b); threads {torch.get_num_threads()}", flush=True)
    print(f"{'draft':<16}{'bytes':>7}{'time':>7}{'(a) acc':>9}{'rate':>6}{'(b) acc':>9}{'rate':>6}"
          f"{'(a) x':>7}{'(b) x':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for tail in (int(t) for t in args.tails.split(",")):
            for keep in (int(n) for n in args.layers.split(",")):
                if tail >= keep:
                    continue
                folder = Path(tmp) / f"d{keep}-{tail}"
                make_draft(target_dir, folder, keep, tail)
                draft = DraftModelProposer(folder, target_bytes_per_token=target_bytes, dtype=torch.float32,
                                           device="cpu", num_blocks=64)
                draft_s, paired_target_s = decode_seconds([draft.runner, target.runner], args.repeats)
                cost = draft_s / paired_target_s
                acc = {name: replay(draft, sets[name], refs[name], args.k) for name in sets}
                speedup = {name: (a.mean_accepted + 1) / (1 + args.k * (cost + VERIFY_COST))
                           for name, a in acc.items()}
                label = f"{keep - tail}" + (f"+last{tail}" if tail else "") + f" ({keep}L)"
                print(f"{label:<16}{draft.cost_per_token:>7.3f}{cost:>7.3f}"
                      f"{acc['a'].mean_accepted:>9.2f}{acc['a'].rate:>6.2f}{acc['b'].mean_accepted:>9.2f}"
                      f"{acc['b'].rate:>6.2f}{speedup['a']:>7.2f}{speedup['b']:>7.2f}", flush=True)
                del draft
    print("bytes, time: per drafted token relative to a target decode step; acc: drafts accepted per step "
          f"(of {args.k}); rate: accepted / checked; x: predicted speedup at K={args.k} with the measured time")


if __name__ == "__main__":
    main()
