"""Rank 0's model runner over a group of ranks (tensor-parallel, pipeline stages, or both): it spawns the other
ranks (RankGroup), joins the group, holds shard 0 of stage 0, and for each step sends the batch down the ranks'
pipes, then runs its own part of the step, as they do theirs.

The engine sees one `ModelRunnerLike`: logits [rows, vocab] come back whole on rank 0 (the LM head's vocabulary
columns gathered; with stages, the last stage's hidden states sent back to stage 0's LM head), so scheduling,
sampling and the block manager are the single-rank ones, with one block table that every rank applies to its
own layers and KV heads.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from backends.core.batch import ForwardBatch
from backends.core.engine_config import EngineConfig
from backends.core.engine_errors import EngineDeadError
from backends.executor.collectives import CollectiveCounts, GroupPlace, group_shape, join_group, leave_group
from backends.executor.group import RankGroup
from backends.executor.group_kv import GroupKVCache, group_fingerprint
from backends.executor.messages import Ready
from backends.executor.pipeline import SendCounts, pipeline_step
from backends.executor.rank_process import rss_anon_bytes
from backends.models.model_config import load_model_config
from backends.worker.model_runner import check_group, runner_for

log = logging.getLogger(__name__)


class GroupModelRunner:
    """A ModelRunnerLike (backends/engine/runner.py) and a GroupRunner: `failure()` and `close()`."""

    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        check_group(load_model_config(model_dir), config.tensor_parallel_size,   # before any spawn
                    config.pipeline_parallel_size, config.enable_expert_parallel)
        self.group = RankGroup(config, model_dir)
        try:
            self.place: GroupPlace = join_group(0, group_shape(config, model_dir), self.group.store, 0,
                                                config.device, config.distributed_timeout_s)
            before = rss_anon_bytes()
            # no CUDA graphs: a graph cannot capture the group's collectives
            self.local = runner_for(config, model_dir, 0, self.place)
            self.ranks: list[Ready] = [self._own_report(before), *self.group.wait_ready()]
        except BaseException:
            self.group.fail("rank 0 could not start")
            leave_group()
            raise
        self.config: Any = self.local.config
        self.weights_fingerprint = group_fingerprint(
            f"tp{config.tensor_parallel_size}-pp{config.pipeline_parallel_size}"
            f"{'-ep' if config.enable_expert_parallel else ''}", [ready.weights_fingerprint for ready in self.ranks])
        # what a KV transfer moves and the tiers copy: every rank's layers (None without a KV connector: then no
        # rank shares its cache)
        self.kv_cache = GroupKVCache(self.local.kv_cache, self.ranks[1:]) if config.kv_connector_names else None
        self.num_blocks, self.block_size = self.local.num_blocks, self.local.block_size
        self.max_model_len, self.vocab_size = self.local.max_model_len, self.local.vocab_size
        for ready in self.ranks:
            log.info("rank %d: %.1f MB of weights (read %.1f MB of slices), %.1f MB anonymous resident (%.1f MB "
                     "before its shard), %d KV blocks", ready.rank, ready.weight_bytes / 1e6, ready.read_bytes / 1e6,
                     ready.rss_anon_bytes / 1e6, ready.rss_anon_before_bytes / 1e6, ready.num_blocks)

    def _own_report(self, rss_before: int) -> Ready:
        return Ready(rank=0, num_blocks=self.local.num_blocks, weight_bytes=self.local.weight_bytes(),
                     read_bytes=self.local.read_bytes, rss_anon_bytes=rss_anon_bytes(),
                     rss_anon_before_bytes=rss_before, weights_fingerprint=self.local.weights_fingerprint or "")

    @property
    def counts(self) -> CollectiveCounts:
        """What rank 0's tensor-parallel collectives moved so far (nothing with one rank per stage)."""
        tp = self.place.tensor_parallel
        return CollectiveCounts() if tp is None else tp.counts

    @property
    def send_counts(self) -> SendCounts:
        """What rank 0 sent to the next stage so far (nothing with one stage)."""
        return SendCounts() if self.place.links is None else self.place.links.counts

    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        return self._step(batch, all_hidden=False)[0]

    def execute_with_hidden(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The single runner's answer, computed by the group; EngineDeadError once a rank is lost."""
        return self._step(batch, all_hidden=True)

    def _step(self, batch: ForwardBatch, all_hidden: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if not batch.chunks:
            return self.local.execute_with_hidden(batch)   # nothing runs, on any rank
        self.group.begin_step(batch, all_hidden)
        try:
            if self.place.links is None:
                return self.local.execute_with_hidden(batch)
            result = pipeline_step(self.local, self.place.links, batch, all_hidden)
            assert result is not None   # stage 0's answer
            return result
        except ValueError:   # a malformed batch: every rank refused it before any collective
            raise
        except Exception as exc:  # a collective raised (a rank died or stalled), or rank 0's step broke
            self.group.fail(f"a step failed on rank 0: {exc}")
            raise EngineDeadError(self.group.failure() or str(exc)) from exc
        finally:
            self.group.end_step()

    def failure(self) -> str | None:
        return self.group.failure()

    def close(self) -> None:
        self.group.close()
        leave_group()
