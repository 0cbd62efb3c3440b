"""Pipeline parallelism as the models see it: which decoder layers one stage holds (`PipelineStage`), which
checkpoint tensors it reads, and the check that refuses more stages than layers.

A stage runs its contiguous layers over the hidden states the previous stage sent it; the first stage also
embeds the tokens and holds the LM head (rank 0 samples: the last stage sends its normed hidden states back,
hidden-size wide, rather than vocabulary-wide logits), the last one applies the final norm. Nothing here talks
to another process: the executor (backends/executor/pipeline.py) moves the activations.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_FIRST_STAGE_TENSORS = frozenset({"model.embed_tokens.weight", "lm_head.weight"})


@dataclass(frozen=True, slots=True)
class PipelineStage:
    """Stage `index` of `num_stages`: decoder layers [first_layer, stop_layer) of the model."""
    index: int          # this stage, 0..num_stages-1 (stage 0 holds rank 0)
    num_stages: int     # stages in the pipeline (> 1: a single stage runs with no PipelineStage at all)
    first_layer: int    # the first decoder layer it holds (its index in the checkpoint)
    stop_layer: int     # one past its last

    @classmethod
    def of(cls, num_layers: int, index: int, num_stages: int) -> PipelineStage:
        """An even split (the later stages take one more layer each where it does not divide), or ValueError
        for more stages than layers."""
        if num_stages > num_layers:
            raise ValueError(f"--pipeline-parallel-size {num_stages} is more than the model's {num_layers} layers; "
                             f"choose at most {num_layers}")
        base, extra = divmod(num_layers, num_stages)
        first = index * base + max(0, index - (num_stages - extra))
        size = base + (1 if index >= num_stages - extra else 0)
        return cls(index=index, num_stages=num_stages, first_layer=first, stop_layer=first + size)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def num_layers(self) -> int:
        return self.stop_layer - self.first_layer

    @staticmethod
    def layers_of(stage: PipelineStage | None, num_layers: int) -> range:
        """The model's layers a model built for `stage` holds (all of them without one)."""
        return range(num_layers) if stage is None else range(stage.first_layer, stage.stop_layer)

    def holds(self, name: str) -> bool:
        """Whether this stage reads checkpoint tensor `name`: its layers', the embedding and LM head on the first
        stage, and what no layer owns (the final norm: a few KB) on every stage."""
        layer = _LAYER.match(name)
        if layer is not None:
            return self.first_layer <= int(layer.group(1)) < self.stop_layer
        return self.is_first or name not in _FIRST_STAGE_TENSORS

