"""The synchronous engine: one `step()` = schedule -> runner.execute -> sample (or pool) -> append -> finish.

Single-threaded by contract (the AsyncEngine's background thread owns it). Knows nothing of
HTTP or asyncio; the model runner and the optional KV connector are injected, or built from the config
(the connector by backends/kv_connectors/registry.py). The engine sees only `KVConnector` and the
optional protocols beside it, looked up once here.
"""
from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from backends.core.block_events import KVEventRing
from backends.core.block_manager import BlockManager
from backends.core.engine_config import EngineConfig
from backends.core.engine_errors import EngineRequestError
from backends.core.eos import eos_token_ids
from backends.core.kv_transfer_params import KVTransferParams
from backends.core.outputs import EngineStats, FinishReason, LoadReport, SequenceOutput
from backends.core.sampling_params import SamplingParams
from backends.core.sequence import Sequence, SequenceStatus
from backends.engine.runner import GroupRunner, ModelRunnerLike, build_runner, resolve_model_dir
from backends.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from backends.kv_connectors.base import (
    BlockObserver,
    Closeable,
    ComputeObserver,
    KVConnector,
    LoadContributor,
    WakeTarget,
)
from backends.kv_connectors.multi import find_connector
from backends.kv_connectors.registry import build_kv_connector
from backends.speculative.adaptive import SpecPolicy, StepCost
from backends.speculative.proposer import DraftRequest, Proposer
from backends.structured_output.json_output import JsonOutput
from backends.worker.pooler import pool_last_tokens
from backends.worker.sampler import MAX_LOGPROBS, SampleRow, Verified, verify

__all__ = ["EngineRequestError", "EngineStats", "LLMEngine", "LoadReport", "ModelRunnerLike"]
log = logging.getLogger(__name__)
C = TypeVar("C")

class LLMEngine:
    def __init__(self, config: EngineConfig, runner: ModelRunnerLike | None = None,
                 model_dir: Path | None = None, kv_connector: KVConnector | None = None,
                 proposer: Proposer | None = None) -> None:
        self.config = config
        if runner is None:
            model_dir = model_dir or resolve_model_dir(config)
            runner = build_runner(config, model_dir)
        self.runner = runner
        self._group = runner if isinstance(runner, GroupRunner) else None   # a tensor-parallel group's rank 0
        self.weights_fingerprint: str = getattr(runner, "weights_fingerprint", None) or ""   # "": the runner has none
        self.block_size = runner.block_size
        self.vocab_size = runner.vocab_size
        self.hidden_size = int(runner.config.hidden_size)   # an embedding's length
        self.eos_token_ids = eos_token_ids(runner.config, model_dir)
        self.json_output = JsonOutput(model_dir, self.eos_token_ids, self.vocab_size)
        capacity = runner.num_blocks * runner.block_size
        wanted = config.max_model_len or runner.max_model_len
        if wanted > capacity:
            log.warning("max_model_len %d exceeds the KV cache (%d tokens): capped", wanted, capacity)
        self.max_model_len = min(wanted, runner.max_model_len, capacity)
        self.kv_events = KVEventRing(config.max_kv_events)
        self.block_manager = BlockManager(runner.num_blocks, runner.block_size,
                                          config.enable_prefix_caching, self.kv_events)
        if kv_connector is None:   # none injected: those the config names (none, one, or a MultiConnector)
            kv_connector = build_kv_connector(config, getattr(runner, "kv_cache", None), self.weights_fingerprint,
                                              self.kv_events)
        self.kv_connector = kv_connector
        if isinstance(kv_connector, BlockObserver):
            self.block_manager.observer = kv_connector
        self._compute_observer = kv_connector if isinstance(kv_connector, ComputeObserver) else None
        self._load_contributor = kv_connector if isinstance(kv_connector, LoadContributor) else None
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.watermark_blocks, kv_connector)
        if proposer is None and config.speculative is not None:
            from backends.speculative.factory import build_proposer
            proposer = build_proposer(config, runner)
        self.proposer = proposer
        self.spec_policy = None if proposer is None else SpecPolicy(
            config.num_speculative_tokens, proposer.cost_per_token, adaptive=config.spec_adaptive)
        self.step_cost = StepCost()   # step time against rows: a draft row's price, a prompt token's
        self._spec_clock = 0          # steps that had draft candidates: probes fall on its multiples
        self._counts = dict.fromkeys(("prompt", "cached", "generated", "finished", "failed", "steps",
                                      "spec_proposed", "spec_accepted", "spec_verifications"), 0)

    def set_wake(self, wake: Callable[[], None]) -> None:
        """How a KV connector's own thread (the tiers' loader) gets the engine thread stepping when a load ends."""
        if isinstance(self.kv_connector, WakeTarget):
            self.kv_connector.set_wake(wake)

    def close(self) -> None:
        """Stop the KV connector's threads and a group's other ranks (the engine is not stepped after this)."""
        if isinstance(self.kv_connector, Closeable):
            self.kv_connector.close()
        if self._group is not None:
            self._group.close()

    def failure(self) -> str | None:
        """Why the engine can never step again (its group lost a rank), or None; any thread."""
        return None if self._group is None else self._group.failure()

    def find_kv_connector(self, kind: type[C]) -> C | None:
        """The KV connector of class `kind` (the P/D connector, for the server's holds), if the engine has one."""
        return find_connector(self.kv_connector, kind)

    # --- requests -----------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams,
                 kv_transfer: KVTransferParams | None = None) -> None:
        """Raise EngineRequestError for a request that can never run; pure, any thread."""
        self._validate_prompt(prompt_token_ids, self.max_model_len - 1, "output included")
        _validate_params(params)
        first = () if kv_transfer is None else kv_transfer.first_token_ids
        if any(not 0 <= t < self.vocab_size for t in first):
            raise EngineRequestError(f"first token ids must be in [0, {self.vocab_size})")
        if len(prompt_token_ids) + len(first) > self.max_model_len:
            raise EngineRequestError("prompt and first tokens exceed the context")
        if params.structured:   # the grammar's code runs for structured requests alone
            self.json_output.check(params, first)

    def validate_embedding(self, prompt_token_ids: list[int]) -> None:
        """`validate` for an embedding input: no output, so the prompt may fill the context."""
        self._validate_prompt(prompt_token_ids, self.max_model_len, "which an embedding input may fill")

    def _validate_prompt(self, prompt_token_ids: list[int], max_tokens: int, what: str) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise EngineRequestError("the prompt is empty")
        if n > max_tokens:
            raise EngineRequestError(f"the prompt has {n} tokens; this model's context is {self.max_model_len} "
                                     f"tokens, {what}")
        if any(not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise EngineRequestError(f"prompt token ids must be in [0, {self.vocab_size})")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    kv_transfer: KVTransferParams | None = None) -> None:
        """Queue a sequence; with `kv_transfer.first_token_ids` (a decode leg) it goes on after them,
        so the sampler's step index continues where the prefill worker left off."""
        self.validate(prompt_token_ids, params, kv_transfer)
        if self.scheduler.get(request_id) is not None:
            raise EngineRequestError(f"request id {request_id!r} is already running")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        seq = Sequence(request_id, tuple(prompt_token_ids), params, seed, kv_transfer=kv_transfer)
        for token in () if kv_transfer is None else kv_transfer.first_token_ids:
            seq.append_token(token)
        if params.structured:
            self.json_output.start(seq)
        self.scheduler.add(seq)

    def add_embedding(self, request_id: str, prompt_token_ids: list[int]) -> None:
        """Queue an embedding input: prefilled like any prompt, it finishes with one output carrying its
        pooled vector (pooler.py) once its last chunk has run, and is never sampled."""
        self.validate_embedding(prompt_token_ids)
        if self.scheduler.get(request_id) is not None:
            raise EngineRequestError(f"request id {request_id!r} is already running")
        self.scheduler.add(Sequence(request_id, tuple(prompt_token_ids), None, seed=0))

    def abort_request(self, request_id: str, error: str | None = None) -> SequenceOutput | None:
        """Cancel now and free its blocks; the final output, or None if unknown (idempotent)."""
        seq = self.scheduler.abort(request_id, error)
        if seq is None:
            return None
        self._release_spec(request_id)
        return self._final(seq)

    def abort_all(self, error: str) -> list[SequenceOutput]:
        """Abort every live sequence but those waiting for a KV load (their own request ends them)."""
        aborted = self.scheduler.abort_all(error)
        for seq in aborted:
            self._release_spec(seq.request_id)
        return [self._final(seq) for seq in aborted]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_steps(self) -> int:
        return self._counts["steps"]

    def stats(self) -> EngineStats:
        c = self._counts
        return EngineStats(c["prompt"], c["cached"], c["generated"], self.scheduler.num_preemptions,
                           c["finished"], c["failed"], c["steps"], c["spec_proposed"], c["spec_accepted"],
                           c["spec_verifications"], "" if self.proposer is None else self.proposer.name)

    def load_report(self) -> LoadReport:
        sched, bm, c = self.scheduler, self.block_manager, self._counts
        return self.add_connector_load(LoadReport(
            sched.num_running, sched.num_waiting, sched.num_prefill_tokens_pending(), sched.num_decode_tokens_pending(),
            bm.num_free_blocks, bm.num_total_blocks, bm.num_cached_blocks, bm.block_size, bm.num_held_blocks,
            c["spec_proposed"], c["spec_accepted"], c["prompt"], c["cached"], weights=self.weights_fingerprint))

    def add_connector_load(self, report: LoadReport) -> LoadReport:
        """`report` with the KV connector's own figures (the tiers'), read now; any thread."""
        return report if self._load_contributor is None else self._load_contributor.add_to_report(report)

    # --- one step -----------------------------------------------------------------------------
    def step(self) -> list[SequenceOutput]:
        if self.proposer is not None:
            self._propose()
        out = self.scheduler.schedule()
        if self.kv_connector is not None:
            self.kv_connector.start_load_kv()
        outputs = [self._final(seq) for seq in out.failed]
        for seq in (*out.failed, *out.preempted):
            self._release_spec(seq.request_id)
        if out.is_empty:
            return outputs
        self._counts["steps"] += 1
        started = time.perf_counter()
        try:
            observed = self.proposer is not None and self.proposer.wants_hidden
            pooled = [s.want_embedding for s in out.scheduled]
            hidden = None
            if observed or any(pooled):
                logits, hidden = self.runner.execute_with_hidden(out.batch)
            else:
                logits = self.runner.execute(out.batch)  # [rows: 1 + drafts per chunk wanting logits, vocab]
            vectors = iter(pool_last_tokens(hidden, out.batch, pooled) if hidden is not None else [])
            sampled = [s for s in out.scheduled if s.want_logits]
            verified = iter(verify(logits, [self._row(s.seq) for s in sampled],
                                   [s.seq.spec_token_ids[:s.num_spec_tokens] for s in sampled]))
            if self.proposer is not None or self._compute_observer is not None:   # the step-time fit's only readers
                self.step_cost.observe(out.batch.num_tokens, time.perf_counter() - started)
            if self._compute_observer is not None:   # the tiers price their reads against it, and report it
                self._compute_observer.observe_compute(self.step_cost.per_row_seconds())
            rejected = [0] * len(out.scheduled)
            finishing: list[tuple[Sequence, FinishReason]] = []
            appended: list[SequenceOutput] = []
            for i, s in enumerate(out.scheduled):
                if s.want_logits:
                    v = next(verified)
                    rejected[i] = s.num_spec_tokens - v.num_accepted
                    output = self._append(s, v)
                    appended.append(output)
                    if output.finish_reason is not None:
                        finishing.append((s.seq, output.finish_reason))
                elif s.want_embedding:
                    appended.append(self._embedded(s.seq, next(vectors)))
                    finishing.append((s.seq, FinishReason.STOP))
            self.scheduler.postprocess(out, rejected)
            if observed and hidden is not None:
                self._observe(out, rejected, hidden)
        except Exception as exc:  # boundary: fail this step's sequences only, keep serving
            log.exception("engine step failed; failing its %d sequences", len(out.scheduled))
            for s in out.scheduled:
                self.scheduler.finish(s.seq, FinishReason.ABORT, f"engine step failed: {exc!r}")
                self._release_spec(s.seq.request_id)
                outputs.append(self._final(s.seq))
            return outputs
        outputs.extend(appended)
        for seq, reason in finishing:
            self.scheduler.finish(seq, reason)
            self._counts["finished"] += 1
            self._release_spec(seq.request_id)
        return outputs

    def _propose(self) -> None:
        """Ask the proposer for drafts for every decoding sequence; the policy picks each one's k together."""
        assert self.proposer is not None and self.spec_policy is not None
        policy = self.spec_policy
        candidates: list[tuple[Sequence, int]] = []
        for seq in self.scheduler.running:
            seq.spec_token_ids = []
            if seq.params is None or seq.status is not SequenceStatus.RUNNING or seq.is_prefilling \
                    or not seq.params.speculative or seq.json_state is not None:   # no JSON mask checks a draft
                continue
            cap = min(seq.params.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens)
            if cap > 0:
                candidates.append((seq, cap))
        if not candidates:
            return
        self._spec_clock += 1
        ks = policy.plan([seq.spec for seq, _ in candidates], [cap for _, cap in candidates], *self.step_cost.fit(),
                         len(self.scheduler.running), tick=self._spec_clock % policy.probe_every == 0)
        drafting = [(seq, k) for (seq, _), k in zip(candidates, ks, strict=True) if k > 0]
        if not drafting:
            return
        try:
            drafts = self.proposer.propose([DraftRequest(seq.request_id, seq.token_ids, k) for seq, k in drafting])
        except Exception:  # boundary: a failing proposer costs speed, never a request
            log.exception("speculative proposer %s failed; decoding without drafts this step", self.proposer.name)
            return
        for (seq, k), draft in zip(drafting, drafts, strict=True):
            tokens = [int(t) for t in draft[:k]]
            seq.spec_token_ids = tokens if all(0 <= t < self.vocab_size for t in tokens) else []

    def _observe(self, out: SchedulerOutput, rejected: list[int], hidden: torch.Tensor) -> None:
        """Hand the proposer the target's hidden states of the positions this step verified."""
        assert self.proposer is not None
        offset = 0
        for i, (s, chunk) in enumerate(zip(out.scheduled, out.batch.chunks, strict=True)):
            num_valid = s.num_new_tokens - rejected[i]
            if not s.seq.is_finished and s.seq.status is SequenceStatus.RUNNING and not s.seq.is_embedding:
                self.proposer.observe(s.seq.request_id, chunk.num_context_tokens, s.seq.token_ids,
                                      hidden[offset:offset + num_valid])
            offset += len(chunk.token_ids)

    def _release_spec(self, request_id: str) -> None:
        if self.proposer is not None:
            self.proposer.free(request_id)

    def _row(self, seq: Sequence) -> SampleRow:
        assert seq.params is not None, "an embedding input is never sampled"
        return SampleRow(seq.params, seq.seed, seq.prompt_token_ids, seq.output_token_ids, self.eos_token_ids,
                         None if seq.json_state is None else self.json_output.allowed(seq))

    def _append(self, s: ScheduledSeq, v: Verified) -> SequenceOutput:
        """Append the step's tokens up to the first that ends the sequence (the caller finishes it)."""
        seq = s.seq
        assert seq.params is not None, "an embedding input is never sampled"
        if seq.num_output_tokens == 0:
            self._count_prompt(seq)
        if s.num_spec_tokens:
            self._counts["spec_proposed"] += s.num_spec_tokens
            self._counts["spec_accepted"] += v.num_accepted
            self._counts["spec_verifications"] += 1
            seq.spec.record(s.num_spec_tokens, v.num_accepted)
        reason = None
        count = 0
        for token in v.token_ids:
            seq.append_token(token)
            if seq.json_state is not None:
                self.json_output.advance(seq, token)
            count += 1
            reason = self._finish_reason(seq, token)
            if reason is not None:
                break
        self._counts["generated"] += count
        logprobs = v.logprobs[:count] if seq.params.logprobs is not None else None
        return SequenceOutput(seq.request_id, v.token_ids[:count], logprobs,  # type: ignore[arg-type]
                              reason, seq.num_prompt_tokens, seq.num_cached_tokens)

    def _embedded(self, seq: Sequence, vector: bytes) -> SequenceOutput:
        """An embedding input's one output, its last chunk run (the caller finishes it)."""
        self._count_prompt(seq)
        return SequenceOutput(seq.request_id, (), None, FinishReason.STOP, seq.num_prompt_tokens,
                              seq.num_cached_tokens, embedding=vector)

    def _count_prompt(self, seq: Sequence) -> None:
        self._counts["prompt"] += seq.num_prompt_tokens
        self._counts["cached"] += seq.num_cached_tokens

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        assert p is not None
        stops = (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
        if stops and seq.num_output_tokens >= p.min_tokens:
            return FinishReason.STOP
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _final(self, seq: Sequence) -> SequenceOutput:
        self._counts["finished"] += 1
        if seq.error is not None:
            self._counts["failed"] += 1
        return SequenceOutput(seq.request_id, (), None, seq.finish_reason or FinishReason.ABORT,
                              seq.num_prompt_tokens, seq.num_cached_tokens, seq.error)


def _validate_params(p: SamplingParams) -> None:
    checks = (
        (p.max_tokens >= 1, "max_tokens must be at least 1"),
        (p.temperature >= 0.0, "temperature must be >= 0"),
        (0.0 < p.top_p <= 1.0, "top_p must be in (0, 1]"),
        (0.0 <= p.min_p <= 1.0, "min_p must be in [0, 1]"),
        (p.repetition_penalty > 0.0, "repetition_penalty must be > 0"),
        (p.min_tokens >= 0, "min_tokens must be >= 0"),
        (p.logprobs is None or 0 <= p.logprobs <= MAX_LOGPROBS, f"logprobs must be in [0, {MAX_LOGPROBS}]"),
    )
    for ok, message in checks:
        if not ok:
            raise EngineRequestError(message)
