"""Builds the proposer an EngineConfig names (imported only when speculation is on)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from backends.engine.config import EngineConfig
from backends.spec.ngram import NgramProposer
from backends.spec.proposer import Proposer


def build_proposer(config: EngineConfig, runner: Any) -> Proposer:
    """`runner`: the target's model runner (its model, dtype, device and size, for model proposers)."""
    if config.speculative == "ngram":
        return NgramProposer(config.ngram_min, config.ngram_max)
    if config.speculative == "draft":
        from backends.spec.draft import DraftModelProposer
        assert config.speculative_model is not None
        return DraftModelProposer.for_target(Path(config.speculative_model), runner)
    if config.speculative == "eagle":
        from backends.spec.eagle import EagleProposer
        assert config.speculative_model is not None
        return EagleProposer.for_target(Path(config.speculative_model), runner)
    raise ValueError(f"unknown speculative proposer {config.speculative!r}")
