"""What a model's KV cache depends on, as one short digest: the bytes of every weight, by name, and the config
fields that shape the forward pass (the rotary base and scaling, the norms' epsilon, the head counts).

KV tiers that outlive a worker or are shared between workers (a local disk, the shared store) file their
blocks under it (backends/kv_connectors/tiers/base.namespace), and the two ends of a KV transfer compare theirs
(backends/kv_transfer/base.KVLayout). A worker then never reads KV that other weights computed: a fine-tune or
a new revision in a folder of the same name (a rolling upgrade), or the same weights with another rotary
scaling. The same weights and config give the same digest in any folder, and whether they are compressed on
disk or not.

It reads every weight once, at the speed of CRC-32C's hardware instruction: 0.04 s for SmolLM2-135M's 538 MB
in float32 on one core of the 2-core VM, 15% of the model runner's build (benchmarks/fingerprint_cost.py).
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

import crc32c
import torch

from backends.models.layers import CompressedWeight, dense

# Config keys that do not change what the model computes (besides those that start with "_", such as
# `_name_or_path`): the transformers version that wrote it, and the dtype the weights were saved in
# (the worker's own dtype is part of the KV layout, which the namespace names apart).
_IGNORED_KEYS = frozenset({"transformers_version", "torch_dtype", "dtype"})


def model_fingerprint(config: Any, weights: Mapping[str, torch.Tensor | CompressedWeight]) -> str:
    """A hex digest of `config` (an HF config object or a namespace of its fields) and `weights` (tensors by
    their checkpoint names)."""
    return digest_of(config, [tensor_line(name, weights[name]) for name in weights])


def tensor_line(name: str, weight: torch.Tensor | CompressedWeight) -> str:
    """One tensor's part of a fingerprint: its name, dtype, shape and the CRC-32C of its bytes."""
    tensor = dense(weight).detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data   # a memoryview: no copy
    return f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|{crc32c.crc32c(data):08x}\n"


def digest_of(config: Any, lines: Iterable[str]) -> str:
    """The digest of a config and its tensors' `tensor_line`s, in any order (taken by name, as always)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps(_config_fields(config), sort_keys=True, default=str).encode())
    for line in sorted(lines, key=lambda line: line.split("|", 1)[0]):
        digest.update(line.encode())
    return digest.hexdigest()


def _config_fields(config: Any) -> dict[str, Any]:
    fields = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    return {k: v for k, v in fields.items() if not k.startswith("_") and k not in _IGNORED_KEYS}
