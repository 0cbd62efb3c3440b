"""Layers the model files share: fused linear, LM head, RMSNorm and rotary embeddings (nn.Module and pure
functions). Which kernels they run is chosen once, when the model is built (backends/models/kernels): nothing
here asks which device it runs on."""
from __future__ import annotations

import math
from typing import Protocol, TypeVar

import torch
from torch import nn

from backends.models.kernels.base import GemvConfig, LayerKernels
from backends.models.model_config import ModelConfig

_M = TypeVar("_M", bound=nn.Module)


def choose_transposed(in_features: int, out_features: int) -> bool:
    """Unpacked float32 layouts: x @ W with W stored [in, out] streams weights faster than F.linear's
    [out, in] when the layer widens (measured on CPU before packing; harmless on CUDA). Linear.load
    keeps [out, in] in half precision."""
    return out_features >= in_features


class CompressedWeight(Protocol):
    """A weight kept compressed (backends.compression.CompressedTensor), expanded on demand."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def decompress(self, out: torch.Tensor | None = None) -> torch.Tensor: ...


def dense(weight: torch.Tensor | CompressedWeight) -> torch.Tensor:
    return weight if isinstance(weight, torch.Tensor) else weight.decompress()


class ExpandScratch:
    """One buffer per model that each layer with compressed weights expands them into just before it
    runs (layers run one after another, so one buffer the size of the largest layer serves all)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def take(self, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = shape[0] * shape[1]
        buffer = self._buffer
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype or buffer.device != device:
            buffer = self._buffer = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel].view(shape)


class Linear(nn.Module):
    """y = x W^T (+ bias) over 2-D x, W fused from HF [out, in] tensors: packed where the kernels pack it
    (oneDNN on CPU in float32; `weight` is then empty), else stored [in, out] when that is faster; or kept
    compressed and expanded into the model's ExpandScratch at every call (`compressed`; `weight` is then empty)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, kernels: LayerKernels) -> None:
        super().__init__()
        self.kernels = kernels
        self.in_features, self.out_features = in_features, out_features
        self.transposed = choose_transposed(in_features, out_features)
        shape = (in_features, out_features) if self.transposed else (out_features, in_features)
        self.weight = nn.Parameter(torch.empty(shape), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None
        self.packed_wide: torch.Tensor | None = None   # float32, for steps of kernels.wide_rows rows or more
        self.compressed: tuple[CompressedWeight, ...] = ()
        self.scratch: ExpandScratch | None = None
        # on CUDA: the Triton kernel that projects one row faster than cuBLAS (triton_ops.tune_linears)
        self.gemv_config: GemvConfig | None = None

    def gemv_eligible(self) -> bool:
        """A plain [out, in] weight that triton_ops.gemv can read (tune_linears asks, for the Triton kernels)."""
        return (self.weight.dim() == 2 and not self.transposed and self.bias is None and self.packed is None
                and not self.compressed)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ bias), plus `residual` when given: for a plain weight through the kernels' linear_add (on
        CUDA one addmm, the add riding in the matrix product's epilogue). One row goes through the kernels'
        gemv where tune_linears found it faster than cuBLAS for this shape."""
        if self.gemv_config is not None and residual is None and x.shape[0] == 1:
            return self.kernels.gemv(x, self.weight, self.gemv_config)
        if residual is not None and self.bias is None and self.packed is None and not self.compressed:
            return self.kernels.linear_add(x, self.weight, self.transposed, residual)
        out = self._project(x)
        return out if residual is None else residual + out

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_wide is not None and x.shape[0] >= self.kernels.wide_rows:
            bias = None if self.bias is None else self.bias.float()
            return self.kernels.packed_linear(x.float(), self.packed_wide, bias).to(x.dtype)
        if self.packed is not None:
            return self.kernels.packed_linear(x, self.packed, self.bias)
        if self.compressed:
            return self.kernels.linear(x, self.expanded_weight(), self.bias)
        if not self.transposed:
            return self.kernels.linear(x, self.weight, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight)
        return torch.addmm(self.bias, x, self.weight)

    def expanded_weight(self) -> torch.Tensor:
        """The [out, in] weight, expanded from its compressed parts into the shared scratch."""
        assert self.scratch is not None
        out = self.scratch.take((self.out_features, self.in_features), self.weight.dtype, self.weight.device)
        row = 0
        for part in self.compressed:
            part.decompress(out[row:row + part.shape[0]])
            row += part.shape[0]
        return out

    def load(self, weights: list[torch.Tensor | CompressedWeight], biases: list[torch.Tensor] | None,
             scratch: ExpandScratch | None = None) -> None:
        """Fuse HF [out, in] weights (stacked along out). Compressed weights stay compressed when a
        `scratch` is given (they must then have the model's dtype and device), else are expanded once."""
        if self.bias is not None:
            if biases is None:
                raise KeyError("checkpoint lacks a bias this layer needs")
            self.bias.copy_(torch.cat(biases, 0))
        compressed = [w for w in weights if not isinstance(w, torch.Tensor)]
        if scratch is not None and len(compressed) == len(weights):
            self._keep_compressed(compressed, scratch)
            return
        if self.transposed and self.weight.dtype != torch.float32:
            # In bf16/fp16, CPU matmuls against an [in, out] weight ran 18-20x slower than F.linear
            # on [out, in] (1-8 rows, SmolLM2's shapes); on CUDA both layouts are fine.
            self.transposed = False
            self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features, dtype=self.weight.dtype,
                                                   device=self.weight.device), requires_grad=False)
        fused = self._fused([dense(w) for w in weights])
        self.packed = self.kernels.pack(fused, self.weight.dtype)
        if self.packed is not None:
            # from the rounded weight: a wide step multiplies the values a narrow one does
            self.packed_wide = self.kernels.pack_wide(fused.to(self.weight.dtype), self.weight.dtype)
            self.weight = nn.Parameter(torch.empty(0), requires_grad=False)   # the packed copy replaces it
            return
        if fused is not self.weight:
            self.weight.copy_(fused.t() if self.transposed else fused)

    def _fused(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The HF [out_i, in] parts as one [out, in] tensor, each byte copied out of the checkpoint's map at most
        once: the one part itself, or the parts copied straight into their rows (of the weight, where it is laid
        out [out, in]). A torch.cat first, then a copy into the weight, cost a cold start of a 6 GB bf16 model
        10.8 s in the cat and 8.1 s in the copy (docs/benchmarks.md, "Worker cold start against the disk read")."""
        if sum(p.shape[0] for p in parts) != self.out_features or any(p.shape[1:] != (self.in_features,)
                                                                        for p in parts):
            raise ValueError(f"weights {[list(p.shape) for p in parts]} do not fuse into "
                             f"[{self.out_features}, {self.in_features}]")
        if len(parts) == 1:
            return parts[0]
        fused = self.weight if not self.transposed else torch.empty(
            self.out_features, self.in_features, dtype=self.weight.dtype, device=self.weight.device)
        row = 0
        for part in parts:
            fused[row:row + part.shape[0]].copy_(part)
            row += part.shape[0]
        return fused

    def _keep_compressed(self, parts: list[CompressedWeight], scratch: ExpandScratch) -> None:
        dtype, device = self.weight.dtype, self.weight.device
        for part in parts:
            if part.dtype != dtype or part.device != device:
                raise ValueError(f"compressed {part.dtype} weights on {part.device} cannot serve a {dtype} model on "
                                 f"{device}: run with --dtype {str(part.dtype).removeprefix('torch.')}")
        if sum(p.shape[0] for p in parts) != self.out_features or any(p.shape[1:] != (self.in_features,)
                                                                        for p in parts):
            raise ValueError(f"compressed weights {[list(p.shape) for p in parts]} do not fuse into "
                             f"[{self.out_features}, {self.in_features}]")
        self.compressed, self.scratch = tuple(parts), scratch
        self.weight = nn.Parameter(torch.empty(0, dtype=dtype, device=device), requires_grad=False)


class LMHead(nn.Module):
    """Logits = x W^T with W [vocab, hidden] (often the embedding itself); through a packed copy where the
    kernels pack it (on CPU in float32, for oneDNN)."""

    def __init__(self, hidden_size: int, vocab_size: int, kernels: LayerKernels) -> None:
        super().__init__()
        self.kernels = kernels
        # A Tensor, not just a Parameter: a tied head takes nn.Embedding's weight, which torch types as Tensor.
        self.weight: torch.Tensor = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.kernels.packed_linear(x, self.packed, None)
        return self.kernels.linear(x, self.weight, None)

    def load(self, weight: torch.Tensor) -> None:
        self.weight.copy_(weight)
        self.packed = self.kernels.pack(self.weight, self.weight.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels: LayerKernels) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.kernels = kernels

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), the sum written over x where the kernels fuse the two
        (residual_in_norm); without a residual, (norm(x), x)."""
        return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)


def embedding_and_head(config: ModelConfig, kernels: LayerKernels, rows: int) -> tuple[nn.Embedding, LMHead]:
    """An uninitialised embedding table [rows, hidden] and an LM head over the same rows, one tensor when the config
    ties them. `_weight`: load_weights fills the table; the default random init of a 49152 x 576 table cost 0.17 s
    of every worker start."""
    embed = nn.Embedding(rows, config.hidden_size, _weight=torch.empty(rows, config.hidden_size))
    embed.weight.requires_grad_(False)
    head = LMHead(config.hidden_size, rows, kernels)
    if getattr(config, "tie_word_embeddings", False):
        head.weight = embed.weight
    return embed, head


def on_first_stage(module: _M | None) -> _M:
    """The embedding or LM head a model holds; RuntimeError on a later pipeline stage, which holds neither
    (backends/models/pipeline.py)."""
    if module is None:
        raise RuntimeError("only the first pipeline stage holds the embedding and the LM head")
    return module


def rope_inv_freq(config: ModelConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] for the config's rope theta and scaling (default, linear, llama3)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / params["factor"]
    if kind == "llama3":
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise NotImplementedError(f"rope type {kind!r} is not supported")
