"""The EAGLE-style draft head and its proposer: one Llama decoder layer over fc(embed(next token), target
hidden state), with its own one-layer paged KV, sharing the target's embeddings and LM head (whole copies of them
beside a tensor-parallel shard: backends/speculative/vocabulary.py).

Owns the head's weights, KV blocks and per-request drafting state; never touches the target's KV.
Checkpoints use the EAGLE layout (config.json + `fc.*`, `layers.0.*`, optional `d2t` for a reduced
draft vocabulary in EAGLE-3's convention: target id = draft id + d2t[draft id]).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from backends.attention.base import AttentionContext, AttentionShape, StepLayout, create_backend
from backends.core.block_manager import BlockManager
from backends.core.sampling_params import SamplingParams
from backends.core.sequence import Sequence as BlockOwner
from backends.models.base import CausalLM
from backends.models.int8_linear import INT8_COST, int8_available, int8_lm_head, matmul_cost, replace_linears
from backends.models.kernels.base import LayerKernels
from backends.models.kernels.registry import select_kernels
from backends.models.layers import Linear, LMHead, rope_inv_freq
from backends.models.llama import DecoderMLP, LlamaDecoderLayer
from backends.models.model_config import ModelConfig, load_model_config
from backends.speculative.proposer import DraftRequest
from backends.speculative.vocabulary import Vocabulary
from backends.worker.sampler import greedy_tokens

if TYPE_CHECKING:
    from backends.worker.model_runner import ModelRunner

log = logging.getLogger(__name__)

# Hidden states of one request that wait for the head (observed, not yet run) before a catch-up runs
# them at once, so a sequence that stops asking for drafts does not pile them up.
MAX_PENDING_POSITIONS = 256
_KV_SLACK_BLOCKS = 64   # head blocks beyond the target's: each request drafts up to K - 1 positions ahead


class EagleHead(nn.Module):
    """fc(concat(embed(t_{p+1}), h_p)) -> one decoder layer -> hidden that the target's lm_head reads.
    Flat token batches as in backends/models; the embeddings and LM head are the target's (not submodules)."""

    def __init__(self, config: ModelConfig, fc_bias: bool, input_norm: bool, kernels: LayerKernels) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.kernels = kernels
        self.fc = Linear(2 * hidden, hidden, fc_bias, kernels)
        self.layer = LlamaDecoderLayer(config, 0, bool(getattr(config, "attention_bias", False)),
                                       bool(getattr(config, "attention_bias", False)), qk_norm=False,
                                       kernels=kernels)
        self.input_norm = input_norm   # EAGLE-1/2 heads have no input_layernorm on their only layer
        with torch.device("cpu"):
            self.inv_freq = rope_inv_freq(config, self.layer.self_attn.head_dim)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                attn: AttentionContext) -> torch.Tensor:
        """embeds, hidden [num_tokens, hidden] -> head output [num_tokens, hidden]; writes K/V into the cache."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        cos, sin = self.kernels.rotary_tables(self.inv_freq, positions, hidden.dtype)
        x = self.fc(torch.cat((embeds, hidden), dim=-1))
        layer = self.layer
        x = x + layer.self_attn(layer.input_layernorm(x) if self.input_norm else x, cos, sin, attn)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """EAGLE names (`fc.weight`, `layers.0.self_attn.q_proj.weight`, ...); `embed_tokens.weight` ignored."""
        p = "layers.0"
        attn = self.layer.self_attn
        self.fc.load([weights["fc.weight"]], [weights["fc.bias"]] if "fc.bias" in weights else None)
        attn.qkv_proj.load([weights[f"{p}.self_attn.{n}_proj.weight"] for n in "qkv"],
                           _maybe(weights, [f"{p}.self_attn.{n}_proj.bias" for n in "qkv"]))
        attn.o_proj.load([weights[f"{p}.self_attn.o_proj.weight"]], _maybe(weights, [f"{p}.self_attn.o_proj.bias"]))
        cast(DecoderMLP, self.layer.mlp).load(weights, p, None)
        self.layer.post_attention_layernorm.weight.copy_(weights[f"{p}.post_attention_layernorm.weight"])
        if self.input_norm:
            self.layer.input_layernorm.weight.copy_(weights[f"{p}.input_layernorm.weight"])


def _maybe(weights: Mapping[str, torch.Tensor], names: list[str]) -> list[torch.Tensor] | None:
    return [weights[n] for n in names] if all(n in weights for n in names) else None


def read_head_weights(head_dir: Path) -> dict[str, torch.Tensor]:
    """The tensors of an EAGLE head folder: *.safetensors, else pytorch_model.bin."""
    files = sorted(head_dir.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file
        return {name: t for f in files for name, t in load_file(str(f)).items()}
    bin_file = head_dir / "pytorch_model.bin"
    if bin_file.is_file():
        return torch.load(bin_file, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{head_dir} holds neither *.safetensors nor pytorch_model.bin")


@dataclass(frozen=True, slots=True)
class LoadedHead:
    head: EagleHead            # on the target's device and dtype, eval
    draft_token_ids: torch.Tensor | None  # [draft_vocab] int64 target ids the head drafts among; None: all
    config: ModelConfig        # the head's config.json


def load_eagle_head(head_dir: Path, target: Vocabulary, int8: bool = False) -> LoadedHead:
    """Read a head folder in the EAGLE layout for `target` (same hidden size; its vocabulary); `int8`: its
    projections with int8 weights (backends/models/int8_linear.py: CPU targets only)."""
    head_dir = Path(head_dir)
    config = load_model_config(head_dir)
    if config.hidden_size != target.config.hidden_size:
        raise ValueError(f"head hidden size {config.hidden_size} != target's {target.config.hidden_size}")
    if config.num_hidden_layers != 1:
        raise ValueError(f"an EAGLE head has one decoder layer, {head_dir} says {config.num_hidden_layers}")
    weights = read_head_weights(head_dir)
    dtype, device = target.lm_head_weight().dtype, target.lm_head_weight().device
    weights = {name: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
               for name, t in weights.items()}
    head = EagleHead(config, "fc.bias" in weights, "layers.0.input_layernorm.weight" in weights,
                     select_kernels(device))
    head.to(device=device, dtype=dtype)
    if int8:
        replace_linears(head)
    with torch.no_grad():
        head.load_weights(weights)
    draft_ids = None
    if "d2t" in weights:
        d2t = weights["d2t"].long()
        draft_ids = torch.arange(d2t.numel(), device=device) + d2t
        if int(draft_ids.min()) < 0 or int(draft_ids.max()) >= target.config.vocab_size:
            raise ValueError("d2t maps draft tokens outside the target's vocabulary")
    return LoadedHead(head=head.eval(), draft_token_ids=draft_ids, config=config)


@dataclass(eq=False, slots=True)
class _RequestState:
    owner: BlockOwner          # the head's block table and its count of verified positions
    base: int                  # target position of the head's first KV slot (later with a prefix-cache hit)
    pending: list[torch.Tensor] = field(default_factory=list)   # observed hidden rows not yet run
    num_pending: int = 0
    last_out: torch.Tensor | None = None   # [hidden] head output at its last verified position

    @property
    def num_done(self) -> int:
        return self.owner.num_computed_tokens

    @property
    def next_position(self) -> int:
        """Target position of the next hidden state to observe."""
        return self.base + self.num_done + self.num_pending


@dataclass(slots=True)
class _Chunk:
    state: _RequestState
    token_ids: list[int]       # the tokens paired with this chunk's input hiddens
    hidden: torch.Tensor       # [n, hidden]
    first_position: int        # target position of its first row


class EagleProposer:
    """Drafts with an EAGLE head: catch-up over the newly verified (hidden, next token) pairs, then
    greedy drafts from the head's own outputs, both batched over requests."""

    name = "eagle"
    wants_hidden = True

    def __init__(self, head_dir: Path, target: CausalLM, *, num_blocks: int, block_size: int = 16,
                 attention_backend: str | None = None, int8: bool | None = None,
                 vocabulary: Vocabulary | None = None) -> None:
        """`num_blocks`: the target's KV blocks (the head keeps as many positions, in 1/num_layers the memory).
        `int8`: the head's projections and its LM head in int8; None: wherever int8_available says so.
        `vocabulary`: the embedding and LM head the head reads; None: the target's."""
        self.vocabulary: Vocabulary = target if vocabulary is None else vocabulary
        head_weight = self.vocabulary.lm_head_weight()   # [vocab, hidden]
        self.device, self.dtype = head_weight.device, head_weight.dtype
        available = int8_available(self.device, self.dtype)
        self.int8 = available if int8 is None else int8
        if self.int8 and not available:
            raise ValueError(f"int8 drafts need a float32 or bfloat16 target on a CPU with fbgemm, not {self.dtype} "
                             f"on {self.device}")
        loaded = load_eagle_head(head_dir, self.vocabulary, self.int8)
        self.head = loaded.head
        self.draft_token_ids = loaded.draft_token_ids
        # hidden [rows, hidden] -> logits over the draft vocabulary
        self.lm_head: Callable[[torch.Tensor], torch.Tensor] = self.vocabulary.compute_logits
        rows = head_weight if self.draft_token_ids is None else head_weight.index_select(0, self.draft_token_ids)
        with torch.no_grad():
            if self.int8:
                self.lm_head = int8_lm_head(rows)
            elif self.draft_token_ids is not None:
                head = LMHead(target.config.hidden_size, int(rows.shape[0]), self.head.kernels)
                head.to(self.device, self.dtype).load(rows.to(self.dtype))
                self.lm_head = head
        head_cost = (INT8_COST if self.int8 else 1.0) * rows.numel()   # int8_linear.matmul_cost of that head
        self.cost_per_token = (matmul_cost(self.head) + head_cost) / max(1.0, matmul_cost(target))
        log.info("EAGLE head %s: %s weights, %d draft tokens, cost per draft %.3f of a target step", head_dir,
                 "int8" if self.int8 else str(self.dtype).removeprefix("torch."),
                 int(rows.shape[0]), self.cost_per_token)
        attn = self.head.layer.self_attn
        self.block_size = block_size
        self.blocks = BlockManager(num_blocks + _KV_SLACK_BLOCKS, block_size, enable_prefix_caching=False)
        shape = (num_blocks + _KV_SLACK_BLOCKS, block_size, attn.num_kv_heads, attn.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.attention = create_backend(attention_backend, AttentionShape(
            num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            block_size=block_size, scale=attn.head_dim ** -0.5, dtype=self.dtype), self.device)
        self._states: dict[str, _RequestState] = {}

    @classmethod
    def for_target(cls, head_dir: Path, target: ModelRunner, int8: bool | None = None,
                   vocabulary: Vocabulary | None = None) -> EagleProposer:
        """A head beside `target`: its model (embeddings and LM head unless `vocabulary` is given, dtype,
        device), attention backend, block size, and as many KV blocks (tokens) as its cache, which cost
        1/num_layers of its KV memory."""
        return cls(head_dir, target.model, num_blocks=target.num_blocks, block_size=target.block_size,
                   attention_backend=target.attention.name.value, int8=int8, vocabulary=vocabulary)

    # --- the Proposer interface ------------------------------------------------------------------
    def observe(self, request_id: str, start: int, token_ids: Sequence[int], hidden: torch.Tensor) -> None:
        state = self._states.get(request_id)
        if state is not None and not state.base <= start <= state.next_position:
            self.free(request_id)   # a gap (or a restart before our first position): begin again here
            state = None
        if state is None:
            owner = BlockOwner(request_id, (), SamplingParams(), seed=0)
            self.blocks.allocate(owner)
            state = self._states[request_id] = _RequestState(owner=owner, base=start)
        _truncate(state, start)
        state.pending.append(hidden.detach().to(self.dtype).clone())
        state.num_pending += int(hidden.shape[0])
        if state.num_pending > MAX_PENDING_POSITIONS:
            with torch.inference_mode():
                self._catch_up([(state, token_ids)], reserve=0)

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        live = [(i, self._states[r.request_id], r) for i, r in enumerate(requests)
                if r.num_tokens > 0 and r.request_id in self._states]
        if not live:
            return drafts
        with torch.inference_mode():
            self._draft(live, drafts)
        return drafts

    def free(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self.blocks.free(state.owner)

    # --- drafting --------------------------------------------------------------------------------
    def _draft(self, live: list[tuple[int, _RequestState, DraftRequest]], drafts: list[list[int]]) -> None:
        self._catch_up([(s, r.token_ids) for _, s, r in live], reserve=max(r.num_tokens for _, _, r in live) - 1)
        # Only requests whose head has seen every verified position draft (its last output sits at the
        # position just before the request's last token), and only with slots for their drafts.
        ready = []
        outs = []
        for i, s, r in live:
            if (s.last_out is not None and s.num_pending == 0 and s.base + s.num_done == len(r.token_ids) - 1
                    and self.blocks.append_slots(s.owner, r.num_tokens - 1)):
                ready.append((i, s, r))
                outs.append(s.last_out)
        if not ready:
            return
        hidden = torch.stack(outs)   # [requests, hidden]
        tokens = self._argmax(hidden)
        for step in range(max(r.num_tokens for _, _, r in ready)):
            for (i, _, _), token in zip(ready, tokens, strict=True):
                drafts[i].append(token)
            going = [k for k, (_, _, r) in enumerate(ready) if r.num_tokens > step + 1]
            if not going:
                return
            chunks = [_Chunk(ready[k][1], [tokens[k]], hidden[k:k + 1], len(ready[k][2].token_ids) - 1 + step)
                      for k in going]
            hidden = self._run(chunks, [ready[k][1].num_done + step for k in going], last_only=False)
            ready, tokens = [ready[k] for k in going], self._argmax(hidden)

    def _catch_up(self, items: list[tuple[_RequestState, Sequence[int]]], reserve: int) -> None:
        """Run the head over each request's pending pairs (hidden at p, token p + 1), in one forward, with
        KV slots for them and `reserve` more; a request whose slots cannot be had starts over at its
        next observation."""
        chunks = []
        for state, token_ids in items:
            if state.num_pending == 0:
                continue
            first = state.base + state.num_done
            n = min(state.num_pending, len(token_ids) - 1 - first)   # pairs whose next token is known
            if n <= 0:
                continue
            if not self.blocks.append_slots(state.owner, n + reserve):
                self.free(state.owner.request_id)
                continue
            rows = torch.cat(state.pending) if len(state.pending) > 1 else state.pending[0]
            state.pending = [rows[n:]] if n < rows.shape[0] else []
            state.num_pending -= n
            chunks.append(_Chunk(state, list(token_ids[first + 1:first + 1 + n]), rows[:n], first))
        if not chunks:
            return
        outs = self._run(chunks, [c.state.num_done for c in chunks], last_only=True)
        for chunk, out in zip(chunks, outs, strict=True):
            chunk.state.owner.num_computed_tokens += len(chunk.token_ids)
            chunk.state.last_out = out

    def _run(self, chunks: list[_Chunk], contexts: list[int], last_only: bool) -> torch.Tensor:
        """Head outputs [rows, hidden]: the last row of each chunk, or every row; writes the chunks' K/V
        at head slots contexts[i].. (head slot = target position - base)."""
        bs = self.block_size
        slots: list[int] = []
        positions: list[int] = []
        for chunk, context in zip(chunks, contexts, strict=True):
            table = chunk.state.owner.block_table
            slots += [table[j // bs] * bs + j % bs for j in range(context, context + len(chunk.token_ids))]
            positions += range(chunk.first_position, chunk.first_position + len(chunk.token_ids))
        as_index = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        slot_mapping = as_index(slots)
        layout = StepLayout(query_lens=tuple(len(c.token_ids) for c in chunks), context_lens=tuple(contexts),
                            block_tables=tuple(tuple(c.state.owner.block_table) for c in chunks),
                            slot_mapping=slot_mapping, device=self.device)
        attn = AttentionContext(backend=self.attention, metadata=self.attention.prepare(layout),
                                slot_mapping=slot_mapping, k_caches=[self.k_cache], v_caches=[self.v_cache])
        embeds = self.vocabulary.embed(as_index([t for c in chunks for t in c.token_ids]))
        hidden = torch.cat([c.hidden for c in chunks]) if len(chunks) > 1 else chunks[0].hidden
        out = self.head(embeds, hidden, as_index(positions), attn)   # [num_tokens, hidden]
        if not last_only:
            return out
        ends = as_index(list(accumulate(len(c.token_ids) for c in chunks)))
        return out.index_select(0, ends - 1)

    def _argmax(self, hidden: torch.Tensor) -> list[int]:
        best = greedy_tokens(self.lm_head(hidden))   # [rows] draft-vocabulary ids
        if self.draft_token_ids is not None:
            best = self.draft_token_ids.index_select(0, best)
        return [int(t) for t in best.tolist()]


def _truncate(state: _RequestState, start: int) -> None:
    """Forget what was observed at `start` and after (a rollback, or the same positions observed again)."""
    keep = start - state.base - state.num_done
    if keep < 0:
        state.owner.num_computed_tokens = start - state.base   # head KV past it is overwritten later
        state.pending, state.num_pending, state.last_out = [], 0, None
        return
    if keep < state.num_pending:
        rows = torch.cat(state.pending)[:keep]
        state.pending, state.num_pending = ([rows] if keep else []), keep

