"""Builds the proposer an EngineConfig names (imported only when speculation is on)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from backends.core.engine_config import EngineConfig
from backends.speculative.ngram import NgramProposer
from backends.speculative.proposer import Proposer

log = logging.getLogger(__name__)


def build_proposer(config: EngineConfig, runner: Any) -> Proposer:
    """`runner`: the target's model runner (its model, dtype, device and size, for model proposers).
    "ngram+eagle" and "ngram+draft": prompt lookup first, the model proposer where it finds nothing."""
    lookup, plus, kind = (config.speculative or "").rpartition("+")
    if kind == "ngram":
        return NgramProposer(config.ngram_min, config.ngram_max)
    model = _model_proposer(kind, config, runner)
    if not plus:
        return model
    from backends.speculative.lookup_first import LookupFirstProposer
    assert lookup == "ngram"
    return LookupFirstProposer(model, NgramProposer(config.ngram_min, config.ngram_max))


def _model_proposer(kind: str, config: EngineConfig, runner: Any) -> Proposer:
    assert config.speculative_model is not None
    # Over a group of ranks the proposer runs in rank 0, beside its shard (backends/executor/group_runner.py): a
    # draft model whole on its cores, an EAGLE head on stage 0's embedding and LM head, or, where tensor
    # parallelism splits those by vocabulary, on whole copies that rank 0 reads for it.
    runner = getattr(runner, "local", runner)
    if kind == "draft":
        from backends.speculative.draft import DraftModelProposer
        return DraftModelProposer.for_target(Path(config.speculative_model), runner)
    if kind == "eagle":
        from backends.speculative.eagle import EagleProposer
        return EagleProposer.for_target(Path(config.speculative_model), runner,
                                        int8=None if config.spec_int8 else False,
                                        vocabulary=_whole_vocabulary(runner))
    raise ValueError(f"unknown speculative proposer {config.speculative!r}")


def _whole_vocabulary(runner: Any) -> Any:
    """The target's embedding and LM head, whole, beside a tensor-parallel shard; None elsewhere (the target's own)."""
    if getattr(runner, "tensor_parallel", None) is None:
        return None
    from backends.speculative.vocabulary import WholeVocabulary
    vocabulary = WholeVocabulary.read(runner.model_dir, runner.model.config, runner.kernels, runner.dtype,
                                      runner.device)
    log.info("EAGLE head over tensor-parallel ranks: rank 0 holds the whole embedding and LM head for it, %.1f MB",
             vocabulary.weight_bytes() / 1e6)
    return vocabulary
