"""`DisaggAsyncEngine`: the AsyncEngine with disaggregated legs — prefill sequences whose blocks are held
under their request id (the transfer id) until a decode worker releases them or a timer expires them,
and decode sequences whose prompt KV a caller-supplied coroutine pulls into their blocks.

Hold bookkeeping (timers, readers pinning blocks) lives on the event loop; the block manager is only
touched in the engine thread, through commands.
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import torch

from backends.engine.async_engine import AsyncEngine, LoadReport, _Abort, _Add
from backends.engine.config import EngineConfig
from backends.engine.engine import LLMEngine
from backends.engine.errors import EngineRequestError
from backends.engine.outputs import FinishReason, SequenceOutput
from backends.engine.remote_kv import KVHold, RemoteAdmission, RemoteKVEngine
from backends.engine.sampling_params import SamplingParams
from backends.engine.sequence import Sequence as EngineSequence
from backends.kv_transfer.base import SharedRegion

__all__ = ["DisaggAsyncEngine", "DisaggLoadReport", "KVHold", "RemoteAdmission", "RemotePull"]
log = logging.getLogger(__name__)

# Fills the admitted sequence's blocks with the prompt's KV, or raises (the sequence is then aborted).
RemotePull = Callable[[RemoteAdmission], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class DisaggLoadReport(LoadReport):
    num_held_blocks: int = 0          # blocks pinned for a decode worker to pull (neither free nor leaked)


@dataclass(frozen=True, slots=True)
class _AddPrefill:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class _AddRemote:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    first_token_ids: tuple[int, ...]   # tokens the prefill worker sampled


@dataclass(frozen=True, slots=True)
class _RemoteReady:
    request_id: str


@dataclass(frozen=True, slots=True)
class _ReleaseHold:
    handle: int


_DisaggCommand = _AddPrefill | _AddRemote | _RemoteReady | _ReleaseHold


class DisaggAsyncEngine(AsyncEngine):
    def __init__(self, config: EngineConfig, hold_timeout_s: float = 30.0,
                 engine_factory: Callable[[EngineConfig], LLMEngine] | None = None) -> None:
        super().__init__(config, engine_factory or RemoteKVEngine)
        self.hold_timeout_s = hold_timeout_s
        self._holds: dict[str, tuple[KVHold, asyncio.TimerHandle]] = {}   # transfer id -> hold, expiry
        self._draining: list[KVHold] = []     # released while a reader still had their blocks
        self._pins: Counter[int] = Counter()  # block id -> open readers
        self._admissions: dict[str, asyncio.Future[RemoteAdmission | None]] = {}

    async def shutdown(self) -> None:
        for _, timer in self._holds.values():
            timer.cancel()
        self._holds.clear()
        await super().shutdown()   # queues an abort output on every open stream
        for future in self._admissions.values():
            if not future.done():
                future.set_result(None)   # a decode leg still waiting for blocks reads that abort

    # --- the KV cache, for the transfer layer ------------------------------------------------------
    def kv_layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (K, V) cache tensors [num_blocks, block_size, num_kv_heads, head_dim]."""
        engine = self._require_started()
        cache = engine.runner.kv_cache  # type: ignore[attr-defined]
        return list(zip(cache.k, cache.v))

    def kv_region(self) -> SharedRegion | None:
        """Where the cache lies in shared memory (EngineConfig.kv_shared_memory), if it does."""
        return getattr(self._require_started().runner.kv_cache, "shared_region", None)  # type: ignore[attr-defined]

    # --- prefill legs: holds -----------------------------------------------------------------------
    def generate_prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
                         ) -> AsyncIterator[SequenceOutput]:
        """Like generate; a finish by length keeps the prompt's blocks held under `request_id`."""
        return self._start(request_id, prompt_token_ids, params, _AddPrefill(request_id, list(prompt_token_ids), params))

    def hold(self, transfer_id: str) -> KVHold | None:
        entry = self._holds.get(transfer_id)
        return None if entry is None else entry[0]

    def lookup(self, transfer_id: str) -> Sequence[int] | None:
        entry = self._holds.get(transfer_id)
        return None if entry is None else entry[0].block_ids

    def release_transfer(self, transfer_id: str) -> bool:
        """Drop a hold (decode worker's RELEASE, expiry, or no decode leg coming); False if unknown.
        Blocks a reader is still sending are freed once it closes."""
        entry = self._holds.pop(transfer_id, None)
        if entry is None:
            return False
        hold, timer = entry
        timer.cancel()
        self._draining.append(hold)
        self._release_drained()
        return True

    def pin(self, block_ids: Sequence[int]) -> None:
        self._pins.update(block_ids)

    def unpin(self, block_ids: Sequence[int]) -> None:
        self._pins.subtract(block_ids)
        self._release_drained()

    def _release_drained(self) -> None:
        still = []
        for hold in self._draining:
            if any(self._pins[b] > 0 for b in hold.block_ids):
                still.append(hold)
            else:
                self._post(_ReleaseHold(hold.handle))
        self._draining = still

    def _expire(self, transfer_id: str) -> None:
        if self.release_transfer(transfer_id):
            log.info("KV hold %s expired unclaimed after %.1f s", transfer_id, self.hold_timeout_s)

    # --- decode legs: remote KV --------------------------------------------------------------------
    def generate_remote(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                        first_token_ids: Sequence[int], pull: RemotePull) -> AsyncIterator[SequenceOutput]:
        """Admit a sequence whose prompt KV comes from outside: once it has blocks, `pull` fills them
        (on the event loop, while the engine runs others), then it decodes after `first_token_ids`.
        Outputs are the tokens after those. An exception from `pull` aborts the sequence (blocks freed)
        and propagates to the caller."""
        loop = asyncio.get_running_loop()
        command = _AddRemote(request_id, list(prompt_token_ids), params, tuple(first_token_ids))
        self._admissions[request_id] = loop.create_future()
        try:
            queue = self._open(request_id, prompt_token_ids, params, command)
        except BaseException:
            self._admissions.pop(request_id, None)
            raise
        return self._remote_stream(request_id, queue, pull)

    async def _remote_stream(self, request_id: str, queue: asyncio.Queue[SequenceOutput],
                             pull: RemotePull) -> AsyncIterator[SequenceOutput]:
        finished = False
        try:
            admission = await self._admissions[request_id]
            if admission is not None:   # None: the engine ended it first; its final output is queued
                await pull(admission)
                self._post(_RemoteReady(request_id))
            while not finished:
                output = await queue.get()
                finished = output.finish_reason is not None
                yield output
        finally:
            self._admissions.pop(request_id, None)
            if self._streams.get(request_id) is queue:
                del self._streams[request_id]
            if not finished:   # pull failed, client gone or iterator closed: free the blocks
                self._post(_Abort(request_id, None))

    # --- plumbing ----------------------------------------------------------------------------------
    def _open(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
              command: _DisaggCommand) -> asyncio.Queue[SequenceOutput]:
        engine = self._require_started()
        if request_id in self._streams:
            raise EngineRequestError(f"request id {request_id!r} is already running")
        engine.validate(prompt_token_ids, params)
        queue: asyncio.Queue[SequenceOutput] = asyncio.Queue()
        self._streams[request_id] = queue
        self._post(command)  # type: ignore[arg-type]
        return queue

    def _start(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               command: _DisaggCommand) -> AsyncIterator[SequenceOutput]:
        return self._stream(request_id, self._open(request_id, prompt_token_ids, params, command))

    def _apply(self, engine: LLMEngine, commands: list[object]  # type: ignore[override]
               ) -> tuple[list[SequenceOutput], list[asyncio.Future[None]]]:
        """Engine thread: our commands here, the base class's in order around them."""
        assert isinstance(engine, RemoteKVEngine)
        outputs: list[SequenceOutput] = []
        acks: list[asyncio.Future[None]] = []
        for command in commands:
            if isinstance(command, (_Add, _Abort)):
                more, more_acks = super()._apply(engine, [command])
                outputs += more
                acks += more_acks
                continue
            if isinstance(command, _RemoteReady):
                engine.remote_kv_ready(command.request_id)
            elif isinstance(command, _ReleaseHold):
                engine.release_hold(command.handle)
            else:
                outputs.extend(self._add(engine, command))
        return outputs, acks

    @staticmethod
    def _add(engine: RemoteKVEngine, command: _AddPrefill | _AddRemote) -> list[SequenceOutput]:
        try:
            if isinstance(command, _AddPrefill):
                engine.add_prefill_request(command.request_id, command.prompt_token_ids, command.params)
            else:
                engine.add_remote_request(command.request_id, command.prompt_token_ids, command.params,
                                          command.first_token_ids)
        except EngineRequestError as exc:
            return [SequenceOutput(command.request_id, (), None, FinishReason.ABORT,
                                   len(command.prompt_token_ids), 0, str(exc))]
        return []

    def _abortable(self, engine: LLMEngine) -> list[EngineSequence]:
        """A failure of the engine loop spares decode legs whose pull may be in flight: freeing their
        blocks would hand another sequence blocks the pull still writes. They go on once ready."""
        assert isinstance(engine, RemoteKVEngine)
        return [seq for seq in super()._abortable(engine) if not engine.is_pulling(seq.request_id)]

    def _publish(self) -> None:
        """Engine thread (and start()): snapshot load; hand new holds and admissions to the loop
        before the step's outputs, so a hold is registered when its final output arrives."""
        super()._publish()
        engine = self._engine
        assert isinstance(engine, RemoteKVEngine)
        base = self._report
        assert base is not None
        bm = engine.block_manager
        self._report = DisaggLoadReport(*(getattr(base, f) for f in LoadReport.__dataclass_fields__),
                                        num_held_blocks=bm.num_held_blocks)
        holds, admissions = engine.take_new_holds(), engine.take_admissions()
        if holds or admissions:
            self._call_in_loop(self._on_engine_news, holds, admissions)

    def _on_engine_news(self, holds: list[KVHold], admissions: list[RemoteAdmission]) -> None:
        loop = asyncio.get_running_loop()
        for hold in holds:
            timer = loop.call_later(self.hold_timeout_s, self._expire, hold.request_id)
            self._holds[hold.request_id] = (hold, timer)
        for admission in admissions:
            future = self._admissions.get(admission.request_id)
            if future is not None and not future.done():
                future.set_result(admission)
            elif future is None:   # its caller left before admission; the abort is on its way
                log.debug("admission of %s has no waiter", admission.request_id)

    def _deliver(self, outputs: list[SequenceOutput]) -> None:
        for output in outputs:
            future = self._admissions.get(output.request_id)
            if output.finish_reason is not None and future is not None and not future.done():
                future.set_result(None)
        super()._deliver(outputs)
