"""The draft-model proposer: a smaller model that shares the target's tokenizer drafts greedily in its
own paged KV (its own ModelRunner and BlockManager). It never touches the target's cache or blocks.

Per request it remembers the tokens whose KV its cache holds (`fed`). The engine hands it the verified
tokens each step; their common prefix with `fed` is what stays valid, so the drafts the target
rejected are dropped here, without a callback.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path

import torch

from backends.core.batch import ForwardBatch, SeqChunk
from backends.core.block_manager import BlockManager
from backends.core.sampling_params import SamplingParams
from backends.core.sequence import Sequence
from backends.models.int8_linear import matmul_cost
from backends.models.kernels.base import ModuleTree
from backends.speculative.proposer import DraftRequest
from backends.worker.model_runner import ModelRunner
from backends.worker.sampler import greedy_tokens

log = logging.getLogger(__name__)

# Catch-up tokens (a new prompt, or the tokens verified last step) run per propose call, over all
# requests. A longer prompt is prefilled into the draft across steps, and gets no drafts until it
# has caught up: a step never waits for more than this many draft tokens of prefill.
DEFAULT_MAX_CATCHUP_TOKENS = 512


def weight_bytes_per_token(model: ModuleTree, dtype: torch.dtype) -> int:
    """Bytes of weights one decode token reads: every projection matrix and the LM head (the embedding
    table is a one-row lookup unless it is the head). Counted from shapes, so packed or compressed
    layers (whose `weight` is empty) count in full."""
    return int(matmul_cost(model)) * torch.empty((), dtype=dtype).element_size()


@dataclass(slots=True)
class _DraftState:
    seq: Sequence                                   # only its block_table and num_computed_tokens are used
    fed: list[int] = field(default_factory=list)    # tokens whose KV the draft cache holds, from position 0
    num_matched: int = 0                            # leading tokens of `fed` known equal to the engine's


@dataclass(frozen=True, slots=True)
class _Plan:
    index: int                   # the request's place in propose's argument
    state: _DraftState
    chunk: tuple[int, ...]       # tokens to run this step, from position len(state.fed)
    num_drafts: int              # drafts wanted; 0: catching up only (a long prompt)
    block_table: tuple[int, ...] # covers the chunk and the drafts fed back


class DraftModelProposer:
    """Proposer "draft": greedy drafts from any model folder the loader reads whose token ids are the
    target's. `target_bytes_per_token`: weight_bytes_per_token of the target, for cost_per_token.
    KV: `num_blocks`, else `kv_cache_memory_gb`, else the runner's CPU default (1 GiB; on CUDA the
    caller must size it, or the draft would take the share of free memory meant for the target)."""

    name = "draft"
    wants_hidden = False

    def __init__(self, model_dir: Path, *, target_bytes_per_token: int, dtype: torch.dtype, device: str,
                 num_blocks: int | None = None, kv_cache_memory_gb: float | None = None, block_size: int = 16,
                 attention_backend: str | None = None,
                 max_catchup_tokens: int = DEFAULT_MAX_CATCHUP_TOKENS) -> None:
        if target_bytes_per_token <= 0 or max_catchup_tokens <= 0:
            raise ValueError("target_bytes_per_token and max_catchup_tokens must be positive")
        if num_blocks is None and kv_cache_memory_gb is None and torch.device(device).type == "cuda":
            raise ValueError("size the draft model's KV cache (num_blocks or kv_cache_memory_gb) on CUDA")
        self.runner = ModelRunner(Path(model_dir), dtype=dtype, device=device, num_blocks=num_blocks,
                                  block_size=block_size, attention_backend=attention_backend,
                                  kv_cache_memory_gb=kv_cache_memory_gb)
        self.blocks = BlockManager(self.runner.num_blocks, block_size, enable_prefix_caching=False)
        self.max_catchup_tokens = max_catchup_tokens
        self.cost_per_token = weight_bytes_per_token(self.runner.model, dtype) / target_bytes_per_token
        self._states: dict[str, _DraftState] = {}
        log.info("draft model %s: %d layers, %.3f of a target decode step per token, %d KV blocks",
                 model_dir, self.runner.kv_cache.spec.num_layers, self.cost_per_token, self.runner.num_blocks)

    @classmethod
    def for_target(cls, model_dir: Path, target: ModelRunner) -> DraftModelProposer:
        """A draft beside `target`: its dtype, device, attention backend and block size, and as many KV
        blocks (as many tokens) as the target's cache, which cost the draft's share of its layers."""
        return cls(model_dir, target_bytes_per_token=weight_bytes_per_token(target.model, target.dtype),
                   dtype=target.dtype, device=str(target.device), num_blocks=target.num_blocks,
                   block_size=target.block_size, attention_backend=target.attention.name.value)

    @property
    def num_requests(self) -> int:
        """Requests whose KV the draft holds (freed ones are gone)."""
        return len(self._states)

    def propose(self, requests: Seq[DraftRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        plans = self._plan(requests)
        if not plans:
            return drafts
        # Forward 1: every request's catch-up chunk (at least its last token); its argmax is draft 1.
        batch = ForwardBatch(tuple(SeqChunk(p.chunk, len(p.state.fed), p.block_table, want_logits=p.num_drafts > 0)
                                   for p in plans))
        live = [p for p in plans if p.num_drafts > 0]
        firsts = self._forward(batch, plans, [p.chunk for p in plans])
        for plan, token in zip(live, firsts, strict=True):
            drafts[plan.index].append(token)
        # Then one single-token forward per further draft, each request stopping at its own count.
        step = 1
        while live := [p for p in live if p.num_drafts > step]:
            last = [(drafts[p.index][-1],) for p in live]
            batch = ForwardBatch(tuple(SeqChunk(tokens, len(p.state.fed), p.block_table)
                                       for p, tokens in zip(live, last, strict=True)))
            for plan, token in zip(live, self._forward(batch, live, last), strict=True):
                drafts[plan.index].append(token)
            step += 1
        return drafts

    def observe(self, request_id: str, start: int, token_ids: Seq[int], hidden: torch.Tensor) -> None:
        """Never called (wants_hidden is False)."""

    def free(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self.blocks.free(state.seq)

    def _forward(self, batch: ForwardBatch, plans: list[_Plan], fed: Seq[tuple[int, ...]]) -> list[int]:
        """Run `batch`, record its tokens as fed, and return the argmax of every logits row."""
        logits = self.runner.execute(batch)   # [chunks with want_logits, vocab]
        for plan, tokens in zip(plans, fed, strict=True):
            plan.state.fed.extend(tokens)
            plan.state.seq.num_computed_tokens = len(plan.state.fed)
        return greedy_tokens(logits).tolist()

    def _plan(self, requests: Seq[DraftRequest]) -> list[_Plan]:
        """What each request runs this step, its blocks reserved; requests that cannot run are left out."""
        budget = self.max_catchup_tokens
        plans: list[_Plan] = []
        for index, request in enumerate(requests):
            if budget <= 0:
                break
            plan = self._plan_one(index, request, budget)
            if plan is not None:
                plans.append(plan)
                budget -= len(plan.chunk)
        return plans

    def _plan_one(self, index: int, request: DraftRequest, budget: int) -> _Plan | None:
        tokens, runner = request.token_ids, self.runner
        num_tokens = len(tokens)
        if num_tokens == 0 or num_tokens > runner.max_model_len:
            return None
        state = self._states.get(request.request_id)
        if state is None:
            state = self._states[request.request_id] = _DraftState(
                Sequence(request.request_id, (), SamplingParams(), 0))
        valid = _common_prefix(state.fed, tokens, num_tokens - 1, state.num_matched)
        del state.fed[valid:]                         # rejected drafts (and anything else that diverged)
        state.seq.num_computed_tokens = valid
        chunk = tuple(tokens[valid:])
        if max(chunk) >= runner.vocab_size or min(chunk) < 0:
            return None                               # not the draft's vocabulary: nothing to draft from
        # The last draft is never fed back, so the cache needs num_tokens + num_drafts - 1 slots.
        num_drafts = max(0, min(request.num_tokens, runner.max_model_len - num_tokens + 1))
        if len(chunk) > budget:                       # a long prompt: the next part of it, no drafts
            chunk, num_drafts = chunk[:budget], 0
        state.num_matched = valid
        for wanted in dict.fromkeys((num_drafts, min(num_drafts, 1))):   # all drafts, else one
            if self._fit(state.seq, valid + len(chunk) + max(wanted - 1, 0)):
                state.num_matched = valid + len(chunk)   # once fed (drafts fed after it may be rejected)
                return _Plan(index, state, chunk, wanted, tuple(state.seq.block_table))
        return None                                   # the pool is full: no drafts this step

    def _fit(self, seq: Sequence, num_tokens: int) -> bool:
        """Make seq's table cover exactly `num_tokens` tokens' blocks; False (table unchanged past
        its computed tokens) when the pool cannot."""
        self.blocks.trim(seq, num_tokens)
        return self.blocks.append_slots(seq, num_tokens - seq.num_computed_tokens)


def _common_prefix(fed: list[int], tokens: Seq[int], limit: int, num_matched: int) -> int:
    """Length of the common prefix of `fed` and tokens[:limit]. The engine only appends to a request's
    tokens (a preempted one is freed first), so the `num_matched` tokens that matched last step are
    taken as matching still once their last one does: comparing whole lists costs ~2 ms per 8k tokens."""
    n = min(len(fed), limit)
    start = min(num_matched, n)
    if start and fed[start - 1] != tokens[start - 1]:
        start = 0                                   # not the history it had: compare it all
    if fed[start:n] == list(tokens[start:n]):       # the usual case, at C speed
        return n
    return next(i for i in range(start, n) if fed[i] != tokens[i])
