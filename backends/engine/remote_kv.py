"""The engine side of disaggregated serving: prefill sequences whose prompt blocks are held (not freed)
when they finish, and decode sequences whose prompt KV is written from outside before they run.

Engine-thread only, like `LLMEngine`; never touches a KV tensor or a socket (the async layer pulls).
"""
from __future__ import annotations

import secrets
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

from backends.engine.block_manager import BlockManager
from backends.engine.config import EngineConfig
from backends.engine.engine import LLMEngine, ModelRunnerLike
from backends.engine.errors import EngineRequestError
from backends.engine.outputs import FinishReason
from backends.engine.sampling_params import SamplingParams
from backends.engine.scheduler import Scheduler
from backends.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class KVHold:
    request_id: str              # the finished prefill sequence (its id is the transfer id)
    handle: int                  # the block manager's hold handle (what release() takes)
    block_ids: tuple[int, ...]   # held blocks, in sequence order, covering the prompt
    num_tokens: int              # prompt tokens whose KV the blocks hold


@dataclass(frozen=True, slots=True)
class RemoteAdmission:
    request_id: str              # the admitted decode sequence
    block_ids: tuple[int, ...]   # its blocks covering the prompt, in order (the pull's destination)
    num_cached_tokens: int       # leading prompt tokens already local (prefix hits): not pulled


class HoldingScheduler(Scheduler):
    """A scheduler whose chosen sequences keep their blocks held when they finish by length."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, watermark_blocks: int = 1) -> None:
        super().__init__(block_manager, max_num_seqs, max_num_batched_tokens, max_model_len, watermark_blocks)
        self.hold_on_finish: set[str] = set()
        self.new_holds: list[KVHold] = []

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None,
               hold_blocks: bool = False) -> int | None:
        if seq.is_finished:
            return None
        wanted = seq.request_id in self.hold_on_finish
        self.hold_on_finish.discard(seq.request_id)
        # Only a sequence that stopped because its one token is out hands its KV on; an EOS/stop
        # token (reason STOP), an abort or an error frees it.
        hold = hold_blocks or (wanted and reason is FinishReason.LENGTH and error is None)
        block_ids = tuple(seq.block_table)
        handle = super().finish(seq, reason, error, hold)
        if wanted and handle is not None:
            self.new_holds.append(KVHold(seq.request_id, handle, block_ids, seq.num_prompt_tokens))
        return handle


class RemoteKVEngine(LLMEngine):
    """`LLMEngine` plus prefill-and-hold and remote-KV admission (docs/disaggregation.md)."""

    def __init__(self, config: EngineConfig, runner: ModelRunnerLike | None = None,
                 model_dir: Path | None = None) -> None:
        super().__init__(config, runner, model_dir)
        self.scheduler: HoldingScheduler = HoldingScheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
            config.watermark_blocks)
        self._reported: set[str] = set()   # awaiting sequences whose admission was already reported

    def add_prefill_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """A prefill leg: like add_request, but a finish by length holds the prompt's blocks."""
        self.add_request(request_id, prompt_token_ids, params)
        self.scheduler.hold_on_finish.add(request_id)

    def add_remote_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                           first_token_ids: Seq[int]) -> None:
        """A decode leg: the prompt's KV arrives from outside; the sequence goes on after the tokens
        the prefill already sampled (so the sampler's step index continues where it left off)."""
        self.validate(prompt_token_ids, params)
        if not first_token_ids or any(not 0 <= t < self.vocab_size for t in first_token_ids):
            raise EngineRequestError(f"first token ids must be in [0, {self.vocab_size})")
        if len(prompt_token_ids) + len(first_token_ids) > self.max_model_len:
            raise EngineRequestError("prompt and first tokens exceed the context")
        if self.scheduler.get(request_id) is not None:
            raise EngineRequestError(f"request id {request_id!r} is already running")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        seq = Sequence(request_id, tuple(prompt_token_ids), params, seed, remote_kv=True)
        for token in first_token_ids:
            seq.append_token(token)
        self.scheduler.add(seq)

    def take_admissions(self) -> list[RemoteAdmission]:
        """Remote-KV sequences admitted (blocks allocated) since the last call."""
        awaiting = self.scheduler.awaiting_kv
        self._reported &= awaiting.keys()
        out = []
        for request_id, seq in awaiting.items():
            if request_id in self._reported or seq.status is not SequenceStatus.AWAITING_REMOTE_KV:
                continue
            self._reported.add(request_id)
            num_prompt_blocks = self.block_manager.blocks_needed(seq.num_prompt_tokens)
            out.append(RemoteAdmission(request_id, tuple(seq.block_table[:num_prompt_blocks]),
                                       min(seq.num_computed_tokens, seq.num_prompt_tokens)))
        return out

    def is_pulling(self, request_id: str) -> bool:
        """Its admission went out and its ready has not come back: a pull may be writing its blocks,
        so only its own stream may end it (an abort from the stream comes after the pull stops)."""
        return request_id in self._reported and request_id in self.scheduler.awaiting_kv

    def take_new_holds(self) -> list[KVHold]:
        holds, self.scheduler.new_holds = self.scheduler.new_holds, []
        return holds

    def remote_kv_ready(self, request_id: str) -> bool:
        """The pull into the sequence's blocks is complete: it joins the running sequences."""
        seq = self.scheduler.awaiting_kv.get(request_id)
        if seq is None:
            return False
        self._reported.discard(request_id)
        return self.scheduler.remote_kv_ready(request_id, seq.num_prompt_tokens)

    def release_hold(self, handle: int) -> bool:
        return self.block_manager.release(handle)
