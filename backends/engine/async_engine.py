"""The engine as the server sees it: `generate` streams, `embed`, `abort`, load report, stats, KV events.

The step loop runs in ONE background thread, which also builds the engine (torch releases the GIL),
and sleeps on a condition when idle; outputs cross into the event loop with `call_soon_threadsafe`
onto per-request queues.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from backends.core.block_events import KVEventBatch
from backends.core.engine_config import EngineConfig
from backends.core.engine_errors import EngineDeadError, EngineRequestError
from backends.core.kv_transfer_params import KVTransferParams
from backends.core.outputs import FinishReason, LoadReport, SequenceOutput
from backends.core.sampling_params import SamplingParams
from backends.engine.engine import EngineStats, LLMEngine
from backends.kv_transfer.base import SharedRegion

__all__ = ["AsyncEngine", "EngineRequestError", "EngineStats", "LoadReport"]
log = logging.getLogger(__name__)
C = TypeVar("C")
# Re-check after this long when sequences exist but none can be scheduled (held blocks may free).
_IDLE_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | None          # None: an embedding input (LLMEngine.add_embedding)
    kv_transfer: KVTransferParams | None   # its part in a KV transfer (disaggregated legs)


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str
    done: asyncio.Future[None] | None   # resolved once the blocks are freed


_Command = _Add | _Abort


class AsyncEngine:
    def __init__(self, config: EngineConfig,
                 engine_factory: Callable[[EngineConfig], LLMEngine] | None = None) -> None:
        self.config = config
        self._engine_factory = engine_factory or LLMEngine
        self._engine: LLMEngine | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._inbox: list[_Command] = []
        self._stopping = False
        self._woken = False
        self._streams: dict[str, asyncio.Queue[SequenceOutput]] = {}
        self._report: LoadReport | None = None
        self._stats: EngineStats | None = None
        self.max_model_len = 0
        self.block_size = config.block_size
        self.eos_token_ids: tuple[int, ...] = ()
        self.vocab_size = 0
        self.hidden_size = 0

    # --- lifetime -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the step thread, which builds the engine (off the event loop); returns once it is built."""
        self._loop = asyncio.get_running_loop()
        built: asyncio.Future[LLMEngine] = self._loop.create_future()
        self._thread = threading.Thread(target=self._main, args=(built,), name="switchyard-engine", daemon=True)
        self._thread.start()
        try:
            engine = await built
        except BaseException:   # the load failed, or start() was cancelled: the thread must not step
            with self._cond:
                self._stopping = True
                self._cond.notify()
            self._thread = None
            raise
        self.max_model_len, self.block_size = engine.max_model_len, engine.block_size
        self.eos_token_ids, self.vocab_size = engine.eos_token_ids, engine.vocab_size
        self.hidden_size = engine.hidden_size

    async def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        for request_id, queue in list(self._streams.items()):
            queue.put_nowait(SequenceOutput(request_id, (), None, FinishReason.ABORT, 0, 0, "engine shut down"))

    async def warm_structured_output(self) -> None:
        """Build structured output's vocabulary tries (JsonOutput.warm) off the event loop, before serving."""
        await asyncio.to_thread(self._require_started().json_output.warm)

    # --- requests -----------------------------------------------------------------------------
    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 kv_transfer: KVTransferParams | None = None) -> AsyncIterator[SequenceOutput]:
        """Stream a sequence's outputs; raises EngineRequestError at once for a bad request.
        Closing or cancelling the iterator aborts the sequence. A decode leg's outputs are the
        tokens after `kv_transfer.first_token_ids`."""
        engine = self._require_serving()
        if request_id in self._streams:
            raise EngineRequestError(f"request id {request_id!r} is already running")
        engine.validate(prompt_token_ids, params, kv_transfer)
        queue: asyncio.Queue[SequenceOutput] = asyncio.Queue()
        self._streams[request_id] = queue
        self._post(_Add(request_id, list(prompt_token_ids), params, kv_transfer))
        return self._stream(request_id, queue)

    async def _stream(self, request_id: str, queue: asyncio.Queue[SequenceOutput]
                      ) -> AsyncIterator[SequenceOutput]:
        finished = False
        try:
            while not finished:
                output = await queue.get()
                finished = output.finish_reason is not None
                yield output
        finally:
            if self._streams.get(request_id) is queue:
                del self._streams[request_id]
            if not finished:   # closed, cancelled or garbage-collected early: free the blocks
                self._post(_Abort(request_id, None))

    async def embed(self, request_id: str, prompt_token_ids: list[int]) -> SequenceOutput:
        """An embedding input's one output: its vector in `embedding`, or ABORT (with an error when the
        engine failed it). Raises EngineRequestError for a bad input before anything is queued. Cancelled,
        it aborts the sequence, whose blocks are freed in the engine thread's next turn."""
        engine = self._require_serving()
        if request_id in self._streams:
            raise EngineRequestError(f"request id {request_id!r} is already running")
        engine.validate_embedding(prompt_token_ids)
        queue: asyncio.Queue[SequenceOutput] = asyncio.Queue()
        self._streams[request_id] = queue
        self._post(_Add(request_id, list(prompt_token_ids), None, None))
        output = None
        try:
            output = await queue.get()   # the sequence's only output is its final one
            return output
        finally:
            if self._streams.get(request_id) is queue:
                del self._streams[request_id]
            if output is None:
                self._post(_Abort(request_id, None))

    async def abort(self, request_id: str) -> None:
        """Cancel a sequence; returns once its blocks are free. Idempotent."""
        if self._engine is None:
            raise RuntimeError("AsyncEngine.start() has not run")
        if self._stopping or self._thread is None:   # shut down: nothing runs, nothing holds blocks
            return
        done = asyncio.get_running_loop().create_future()
        self._post(_Abort(request_id, done))
        await done

    # --- observation (any time, from the event loop) ------------------------------------------
    def load_report(self) -> LoadReport:
        """The engine's last published load; the KV connector's part (the tiers') read now: their writer and
        loader threads move blocks while the engine thread idles, and they count under their own locks."""
        assert self._report is not None and self._engine is not None, "engine not started"
        return self._engine.add_connector_load(self._report)

    def failure(self) -> str | None:
        """Why the engine can never step again (a rank of its group was lost), or None while it serves."""
        return None if self._engine is None else self._engine.failure()

    def find_kv_connector(self, kind: type[C]) -> C | None:
        """The engine's KV connector of class `kind` (backends/kv_connectors/multi.py), if it has one."""
        return self._require_started().find_kv_connector(kind)

    def stats(self) -> EngineStats:
        assert self._stats is not None, "engine not started"
        return self._stats

    def kv_events(self, since: int, limit: int = 1000) -> KVEventBatch:
        if self._engine is None:
            raise RuntimeError("AsyncEngine.start() has not run")
        return self._engine.kv_events.since(since, limit)

    def kv_layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (K, V) cache tensors [num_blocks, block_size, num_kv_heads, head_dim]."""
        cache = self._require_started().runner.kv_cache  # type: ignore[attr-defined]
        return list(zip(cache.k, cache.v, strict=True))

    def kv_region(self) -> SharedRegion | None:
        """Where the cache lies in shared memory (EngineConfig.kv_shared_memory), if it does."""
        return self._require_started().runner.kv_cache.shared_region  # type: ignore[attr-defined]

    def weights_fingerprint(self) -> str:
        """The weights' fingerprint (backends/worker/fingerprint.py; "" where the runner has none): a KV
        transfer's two ends compare theirs."""
        return self._require_started().weights_fingerprint

    def wake(self) -> None:
        """Any thread: the KV connector has news (finished transfers); step soon, even if idle."""
        with self._cond:
            self._woken = True
            self._cond.notify()

    # --- the step thread ----------------------------------------------------------------------
    def _require_started(self) -> LLMEngine:
        if self._engine is None:
            raise RuntimeError("AsyncEngine.start() has not run")
        if self._stopping:
            raise RuntimeError("AsyncEngine has shut down")
        return self._engine

    def _require_serving(self) -> LLMEngine:
        """The engine, for a new request; EngineDeadError once it can never step again."""
        engine = self._require_started()
        failure = engine.failure()
        if failure is not None:
            raise EngineDeadError(failure)
        return engine

    def _post(self, command: _Command) -> None:
        with self._cond:
            self._inbox.append(command)
            self._cond.notify()

    def _main(self, built: asyncio.Future[LLMEngine]) -> None:
        """The step thread's life: build the engine, then step it, all in this one thread.

        The model must be built in the thread that runs it: a CPU model loaded in one thread and run
        in another took 75 ms a decode step instead of 42 (SmolLM2, 2-core EPYC; docs/benchmarks.md),
        the matmuls' prepacked oneDNN state being tied to the OpenMP team of the thread that made it.
        """
        torch.set_num_threads(self.config.resolved_torch_threads())
        try:
            engine = self._engine_factory(self.config)
        except BaseException as exc:  # noqa: BLE001 - the load error goes to start()'s caller
            self._call_in_loop(_fail, built, exc)
            return
        self._engine = engine
        engine.set_wake(self.wake)
        self._publish()
        self._call_in_loop(_succeed, built, engine)
        try:
            self._run(engine)
        finally:
            engine.close()

    def _run(self, engine: LLMEngine) -> None:
        while True:
            with self._cond:
                while not self._inbox and not engine.has_unfinished() and not self._woken and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                commands, self._inbox = self._inbox, []
                woken, self._woken = self._woken, False
            steps_before = engine.num_steps
            try:
                outputs, acks = self._apply(engine, commands)
                if acks:            # aborts are visible in load_report() before abort() returns
                    self._publish()
                    for ack in acks:
                        self._call_in_loop(_resolve, ack)
                if engine.has_unfinished() or woken:
                    outputs.extend(engine.step())
            except EngineDeadError as exc:   # the group lost a rank: every live sequence ends with the reason
                outputs = engine.abort_all(f"the worker's tensor-parallel group failed: {exc}")
            except Exception:  # boundary: a bug outside a step; fail everything live, keep serving
                log.exception("engine loop failed; aborting all sequences")
                outputs = engine.abort_all("engine loop failed")
            self._publish()
            if outputs:
                self._call_in_loop(self._deliver, outputs)
            elif engine.num_steps == steps_before:
                self._nap()

    def _nap(self) -> None:
        """Nothing could run (all live sequences wait on blocks or remote KV): wait for news."""
        with self._cond:
            if not self._inbox and not self._woken and not self._stopping:
                self._cond.wait(timeout=_IDLE_POLL_S)

    def _apply(self, engine: LLMEngine, commands: list[_Command]
               ) -> tuple[list[SequenceOutput], list[asyncio.Future[None]]]:
        outputs: list[SequenceOutput] = []
        acks: list[asyncio.Future[None]] = []
        for command in commands:
            if isinstance(command, _Add):
                try:
                    if command.params is None:
                        engine.add_embedding(command.request_id, command.prompt_token_ids)
                    else:
                        engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                           command.kv_transfer)
                except EngineRequestError as exc:
                    outputs.append(SequenceOutput(command.request_id, (), None, FinishReason.ABORT,
                                                  len(command.prompt_token_ids), 0, str(exc)))
            else:
                final = engine.abort_request(command.request_id)
                if final is not None:
                    outputs.append(final)
                if command.done is not None:
                    acks.append(command.done)
        return outputs, acks

    def _publish(self) -> None:
        """Snapshot load and stats in the engine thread, so readers never race its dicts."""
        engine = self._engine
        assert engine is not None
        self._report = engine.load_report()
        self._stats = engine.stats()

    def _call_in_loop(self, fn: Callable[..., object], *args: object) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            log.debug("event loop closed; dropped %s", fn)

    def _deliver(self, outputs: list[SequenceOutput]) -> None:
        for output in outputs:
            queue = self._streams.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _succeed(future: asyncio.Future[LLMEngine], engine: LLMEngine) -> None:
    if not future.done():
        future.set_result(engine)


def _fail(future: asyncio.Future[LLMEngine], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
