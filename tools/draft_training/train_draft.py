"""`switchyard train-draft`: distil an EAGLE head from the target within a CPU time budget, save it in the
EAGLE layout and report its acceptance (mean accepted length of greedy drafts on held-out prompts).

Steps: the target writes sampled answers to the built-in prompts (tools/draft_training/train_prompts.py), with the
final hidden states it computed on the way: by default our own engine, many sequences at once
(train_texts.py), or transformers' batched generate (`--generator transformers`); the head learns to
predict the next hidden state (smooth L1) and the target's next-token distribution (cross-entropy); the
saved head is then measured through EagleProposer on transformers' greedy answers to held-out prompts.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from backends.core.paths import default_cache_dir
from backends.models.kernels.base import apply_rotary
from backends.models.layers import rope_inv_freq
from backends.models.model_config import ModelConfig, read_config_json
from backends.speculative.proposer import DraftRequest
from backends.worker.loader import resolve_model
from tools.draft_training.train_prompts import PROSE, STRUCTURED, prompt_sets
from tools.draft_training.train_texts import Sample, collect, engine_samples

log = logging.getLogger("switchyard.train_draft")
EVAL_NEW_TOKENS = 96   # answer length of the held-out greedy texts the acceptance replays


def default_head_dir(model_dir: Path) -> Path:
    return default_cache_dir() / "eagle" / f"{model_dir.name}-head"


# --- the head being trained -----------------------------------------------------------------------
class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape   # x [batch, time, hidden]; cos, sin [time, 1, head_dim // 2]
        q = apply_rotary(self.q_proj(x).view(b, t, self.heads, self.head_dim), cos, sin).transpose(1, 2)
        k = apply_rotary(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim), cos, sin).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class _MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Norm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class _Layer(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        head_dim = config.get("head_dim") or hidden // heads
        self.input_layernorm = _Norm(hidden, config["rms_norm_eps"])
        self.self_attn = _Attention(hidden, heads, config.get("num_key_value_heads") or heads, head_dim)
        self.post_attention_layernorm = _Norm(hidden, config["rms_norm_eps"])
        self.mlp = _MLP(hidden, config["intermediate_size"])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class TrainableHead(nn.Module):
    """The EAGLE head in plain, differentiable PyTorch; its state_dict names are the EAGLE layout's."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.layers = nn.ModuleList([_Layer(config)])
        layer = self.layers[0]
        assert isinstance(layer, _Layer)
        self.inv_freq = rope_inv_freq(cast(ModelConfig, SimpleNamespace(**config)), layer.self_attn.head_dim)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """embeds, hidden [batch, time, hidden] (row p: token p + 1 and hidden p) -> [batch, time, hidden]."""
        freqs = torch.arange(embeds.shape[1], dtype=torch.float32).unsqueeze(1) * self.inv_freq.unsqueeze(0)
        cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)
        x = self.fc(torch.cat((embeds, hidden), dim=-1))
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x

    def init_from(self, target: Any) -> None:
        """Start from the target's last decoder layer, with fc passing the hidden state through."""
        source = target.model.layers[-1]
        layer = self.layers[0]
        assert isinstance(layer, _Layer)
        with torch.no_grad():
            for name, param in layer.named_parameters():
                param.copy_(source.get_parameter(name))
            hidden = self.fc.out_features
            self.fc.weight.normal_(0.0, 0.02)
            self.fc.weight[:, hidden:] = torch.eye(hidden)
            self.fc.bias.zero_()


def _pad(rows: list[torch.Tensor]) -> torch.Tensor:
    return nn.utils.rnn.pad_sequence(rows, batch_first=True)


def train(head: TrainableHead, samples: list[Sample], lm_rows: torch.Tensor, embed: torch.Tensor, *,
          deadline_s: float, tokens_per_batch: int, lr: float, ce_weight: float, seed: int) -> dict[str, float]:
    """Train until `deadline_s` (at least one step). lm_rows [draft_vocab, hidden]: the LM head rows the
    head's distribution is measured on. Loss at head row p (pair hidden p, token p + 1): smooth L1 to
    hidden p + 1, plus ce_weight x cross-entropy against the target's distribution at p + 1."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    start, steps, last = time.monotonic(), 0, {}
    while steps == 0 or time.monotonic() < deadline_s:
        batch = _batch(samples, rng, tokens_per_batch)
        tokens, hidden = _pad([s.token_ids for s in batch]), _pad([s.hidden for s in batch])
        width = tokens.shape[1]   # hidden is one shorter
        mask = torch.zeros(tokens.shape[0], width - 2, dtype=torch.bool)
        for row, s in enumerate(batch):   # prompt positions too: their hidden states are the target's as well
            mask[row, :len(s.token_ids) - 2] = True
        out = head(F.embedding(tokens[:, 1:width - 1], embed), hidden[:, :width - 2])[mask]   # [rows, hidden]
        target = hidden[:, 1:width - 1][mask]
        with torch.no_grad():
            target_p = torch.softmax(target @ lm_rows.T, dim=-1)
        hidden_loss = F.smooth_l1_loss(out, target)
        ce_loss = -(target_p * torch.log_softmax(out @ lm_rows.T, dim=-1)).sum(-1).mean()
        loss = hidden_loss + ce_weight * ce_loss
        fraction = min(1.0, (time.monotonic() - start) / max(1e-9, deadline_s - start))
        for group in optimizer.param_groups:   # warm up, then cosine over the time left
            group["lr"] = lr * min(1.0, (steps + 1) / 20) * 0.5 * (1 + math.cos(math.pi * fraction))
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        optimizer.step()
        steps += 1
        last = {"steps": steps, "hidden_loss": hidden_loss.item(), "ce_loss": ce_loss.item()}
        if steps % 25 == 0:
            log.info("step %d: smooth-L1 %.4f, CE %.4f", steps, last["hidden_loss"], last["ce_loss"])
    return last


def _batch(samples: list[Sample], rng: random.Random, tokens_per_batch: int) -> list[Sample]:
    batch: list[Sample] = []
    tokens = 0
    while not batch or tokens + len(batch[-1].token_ids) <= tokens_per_batch:
        sample = rng.choice(samples)
        batch.append(sample)
        tokens += len(sample.token_ids)
        if len(batch) == len(samples):
            break
    return batch


def draft_vocabulary(samples: list[Sample], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` tokens most frequent in the texts, topped up with the lowest ids (BPE's earliest merges)."""
    counts = Counter(t for s in samples for t in s.token_ids.tolist())
    chosen = {t for t, _ in counts.most_common(size)}
    for t in range(vocab_size):
        if len(chosen) >= size:
            break
        chosen.add(t)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def save_head(out_dir: Path, head: TrainableHead, target_config: dict[str, Any], draft_ids: torch.Tensor | None,
              report: dict[str, Any]) -> None:
    """The EAGLE layout (config.json, model.safetensors), written to a temp folder and renamed into place."""
    from safetensors.torch import save_file
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    tensors = {name: t.detach().contiguous() for name, t in head.state_dict().items()}
    if draft_ids is not None:
        tensors["d2t"] = draft_ids - torch.arange(draft_ids.numel())
    save_file(tensors, str(tmp / "model.safetensors"))
    config = {**target_config, "num_hidden_layers": 1, "architectures": ["LlamaForCausalLM"]}
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (tmp / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    out_dir.chmod(0o755)   # mkdtemp's 0700 (and save_file's 0600): workers of other users read it too
    for path in out_dir.iterdir():
        path.chmod(0o644)


# --- acceptance ------------------------------------------------------------------------------------
def acceptance(head_dir: Path, model_dir: Path, samples: list[Sample], num_speculative_tokens: int) -> dict[str, Any]:
    """Mean accepted length (accepted drafts + the target's own token, per verification) of greedy drafts
    through EagleProposer, replaying the target's greedy answers (its hidden states observed as the
    engine would), per kind."""
    from backends.speculative.eagle import EagleProposer
    from backends.worker.model_runner import ModelRunner

    target = ModelRunner(model_dir, dtype=torch.float32, device="cpu", num_blocks=1).model
    total_tokens = sum(len(s.token_ids) for s in samples)
    proposer = EagleProposer(head_dir, target, num_blocks=total_tokens // 16 + len(samples) * 2)
    k = num_speculative_tokens
    stats = {kind: [0, 0] for kind in (STRUCTURED, PROSE)}   # kind -> [verifications, tokens]
    pos = {}
    for i, s in enumerate(samples):
        m = s.num_prompt_tokens   # the first answer token is sampled; positions < m verified
        proposer.observe(str(i), 0, s.token_ids[:m + 1].tolist(), s.hidden[:m])
        pos[i] = m
    while True:
        live = [i for i, s in enumerate(samples) if pos[i] + k + 1 < len(s.token_ids)]
        if not live:
            break
        drafts = proposer.propose([DraftRequest(str(i), samples[i].token_ids[:pos[i] + 1].tolist(), k) for i in live])
        for i, draft in zip(live, drafts, strict=True):
            s, m = samples[i], pos[i]
            truth = s.token_ids[m + 1:m + 1 + k].tolist()
            accepted = next((j for j, (a, b) in enumerate(zip(draft, truth, strict=False)) if a != b),
                            min(len(draft), len(truth)))
            proposer.observe(str(i), m, s.token_ids[:m + accepted + 2].tolist(), s.hidden[m:m + accepted + 1])
            pos[i] = m + accepted + 1
            stats[s.kind][0] += 1
            stats[s.kind][1] += accepted + 1
    for i in range(len(samples)):
        proposer.free(str(i))
    return {kind: {"mean_accepted_length": round(tokens / max(1, steps), 3), "verifications": steps}
            for kind, (steps, tokens) in stats.items()} | {"cost_per_token": round(proposer.cost_per_token, 4)}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# --- the command -----------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="switchyard train-draft", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="target: 'smollm2', an HF folder or a .gguf (default smollm2)")
    p.add_argument("--out", type=Path, help="head folder (default: $SWITCHYARD_CACHE/eagle/<model>-head)")
    p.add_argument("--budget-minutes", type=float, default=20.0, help="wall-clock budget of the whole run")
    p.add_argument("--max-samples", type=int, default=None, help="training texts at most (default: the budget's)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="answer length per training text")
    p.add_argument("--batch-size", type=int, default=8,
                   help="texts per transformers generate batch (the held-out texts; --generator transformers)")
    p.add_argument("--generator", choices=("engine", "transformers"), default="engine",
                   help="who writes the training answers: our engine (continuous batching, --engine-batch at once) "
                        "or transformers' generate (--batch-size a batch); the held-out texts are transformers'")
    p.add_argument("--engine-batch", type=int, default=32, help="sequences the engine runs at once")
    p.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts measured (default all 8)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="K of the acceptance measurement")
    p.add_argument("--draft-vocab", type=int, default=8192, help="tokens the head drafts among (0: all)")
    p.add_argument("--tokens-per-batch", type=int, default=4096)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ce-weight", type=float, default=0.1, help="weight of the cross-entropy term")
    p.add_argument("--init", choices=("random", "last-layer"), default="random",
                   help="the decoder layer starts random (EAGLE) or as a copy of the target's last layer")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args(argv)
    began = time.monotonic()
    budget_s = args.budget_minutes * 60
    model_dir = resolve_model(args.model)
    out_dir = args.out or default_head_dir(model_dir)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), padding_side="left")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    train_prompts, held_out = prompt_sets(args.seed)
    held_out = held_out[:args.eval_prompts] if args.eval_prompts is not None else held_out
    train_prompts = train_prompts[:args.max_samples] if args.max_samples is not None else train_prompts
    evaluation = collect(model, tokenizer, held_out, batch_size=args.batch_size,
                         max_new_tokens=min(args.max_new_tokens, EVAL_NEW_TOKENS), sample=False, seed=args.seed,
                         deadline_s=None)
    if args.generator == "engine":
        samples = engine_samples(model_dir, tokenizer, train_prompts, batch_size=args.engine_batch,
                                 max_new_tokens=args.max_new_tokens, seed=args.seed, deadline_s=began + 0.5 * budget_s)
    else:
        samples = collect(model, tokenizer, train_prompts, batch_size=args.batch_size,
                          max_new_tokens=args.max_new_tokens, sample=True, seed=args.seed,
                          deadline_s=began + 0.5 * budget_s)
    config = read_config_json(model_dir)
    vocab = config["vocab_size"]
    draft_ids = draft_vocabulary(samples, args.draft_vocab, vocab) if 0 < args.draft_vocab < vocab else None
    embed = model.get_input_embeddings().weight.detach()
    lm_weight = model.get_output_embeddings().weight.detach()
    lm_rows = lm_weight if draft_ids is None else lm_weight.index_select(0, draft_ids)
    head = TrainableHead(config)
    if args.init == "last-layer":
        head.init_from(model)
    del model
    losses = train(head, samples, lm_rows, embed, deadline_s=began + 0.9 * budget_s,
                   tokens_per_batch=args.tokens_per_batch, lr=args.lr, ce_weight=args.ce_weight, seed=args.seed)
    report: dict[str, Any] = {
        "command": " ".join(["switchyard", "train-draft", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": _cpu_name(), "model": str(model_dir),
        "train_texts": len(samples), "train_tokens": sum(len(s.token_ids) for s in samples),
        "draft_vocab": None if draft_ids is None else int(draft_ids.numel()), **losses}
    save_head(out_dir, head, config, draft_ids, report)
    report["acceptance"] = acceptance(out_dir, model_dir, evaluation, args.num_speculative_tokens)
    report["elapsed_s"] = round(time.monotonic() - began, 1)
    report["cpu_s"] = round(time.process_time(), 1)   # this process's CPU time (all threads)
    (out_dir / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    print(f"head saved in {out_dir}; serve it with: "
          f"switchyard worker --speculative eagle --speculative-model {out_dir}")
    return report


if __name__ == "__main__":
    main()
