"""Embeddings from a step's hidden states: the last token's final (normed) hidden state, L2-normalised
(vLLM's default pooling for a decoder served as an embedding model). Like the sampler, it reads what the
model computed and decides nothing about scheduling.
"""
from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import numpy as np
import torch
import torch.nn.functional as F

from backends.core.batch import ForwardBatch


def pool_last_tokens(hidden: torch.Tensor, batch: ForwardBatch, pooled: Sequence[bool]) -> list[bytes]:
    """One vector per chunk flagged in `pooled` (parallel to batch.chunks), in chunk order: its last token's
    row of `hidden` ([num_tokens, hidden_size], batch order) in float32, L2-normalised, as little-endian bytes."""
    ends = accumulate(len(chunk.token_ids) for chunk in batch.chunks)
    rows = [end - 1 for end, wanted in zip(ends, pooled, strict=True) if wanted]
    if not rows:
        return []
    index = torch.tensor(rows, dtype=torch.long, device=hidden.device)
    # The norm in float32 whatever the model's dtype: a bfloat16 sum of squares loses digits the vector keeps.
    vectors = F.normalize(hidden.index_select(0, index).float(), dim=-1).cpu()   # [len(rows), hidden_size]
    return [np.asarray(vector.numpy(), dtype="<f4").tobytes() for vector in vectors]
