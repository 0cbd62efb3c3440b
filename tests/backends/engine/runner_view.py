"""One real ModelRunner shared by the engine tests, seen through a view that can use fewer of
its KV blocks (to force preemption), record each step, raise on chosen steps (worker faults), or
call a hook as each step starts, in the thread that runs it."""
from __future__ import annotations

from collections.abc import Callable

import torch

from backends.core.batch import ForwardBatch
from backends.worker.model_runner import ModelRunner


class RunnerView:
    def __init__(self, runner: ModelRunner, num_blocks: int | None = None) -> None:
        if num_blocks is not None and num_blocks > runner.num_blocks:
            raise ValueError("a view cannot have more blocks than its runner")
        self.inner = runner
        self.config, self.block_size = runner.config, runner.block_size
        self.max_model_len, self.vocab_size = runner.max_model_len, runner.vocab_size
        self.num_blocks = num_blocks or runner.num_blocks
        self.kv_cache = runner.kv_cache   # its first num_blocks blocks are the view's
        self.weights_fingerprint = runner.weights_fingerprint
        self.steps: list[tuple[ForwardBatch, torch.Tensor]] = []
        self.fail_if: Callable[[ForwardBatch], bool] = lambda batch: False
        self.on_step: Callable[[ForwardBatch], None] = lambda batch: None

    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        return self.execute_with_hidden(batch)[0]

    def execute_with_hidden(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        self.on_step(batch)
        if self.fail_if(batch):
            raise RuntimeError("injected runner fault")
        logits, hidden = self.inner.execute_with_hidden(batch)
        self.steps.append((batch, logits.clone()))
        return logits, hidden
