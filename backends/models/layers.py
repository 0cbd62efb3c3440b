"""Layers the model files share: fused linear, LM head, RMSNorm and rotary embeddings (nn.Module and pure functions)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# On CPU, x @ W with W stored [in, out] streams weights ~1.6x faster than F.linear's [out, in] when the
# layer widens (qkv, gate_up, lm_head at one row); F.linear is as fast or faster when it narrows (down_proj)
# and for the lm_head at several rows (measured, 2-core EPYC, fp32). See choose_transposed.


def choose_transposed(in_features: int, out_features: int) -> bool:
    return out_features >= in_features


class Linear(nn.Module):
    """y = x W^T (+ bias) over 2-D x, W fused from HF [out, in] tensors; stored [in, out] when that is faster."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.transposed = choose_transposed(in_features, out_features)
        shape = (in_features, out_features) if self.transposed else (out_features, in_features)
        self.weight = nn.Parameter(torch.empty(shape), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.transposed:
            return F.linear(x, self.weight, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight)
        return torch.addmm(self.bias, x, self.weight)

    def load(self, weights: list[torch.Tensor], biases: list[torch.Tensor] | None) -> None:
        """Fuse HF [out, in] weights (stacked along out)."""
        fused = torch.cat(weights, 0)
        self.weight.copy_(fused.t() if self.transposed else fused)
        if self.bias is not None:
            if biases is None:
                raise KeyError("checkpoint lacks a bias this layer needs")
            self.bias.copy_(torch.cat(biases, 0))


class LMHead(nn.Module):
    """Logits = x W^T with W [vocab, hidden]; on CPU also a [hidden, vocab] copy for single-row steps."""

    def __init__(self, hidden_size: int, vocab_size: int, keep_transposed: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.weight_t = (nn.Parameter(torch.empty(hidden_size, vocab_size), requires_grad=False)
                         if keep_transposed else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_t is not None and x.shape[0] == 1:
            return torch.mm(x, self.weight_t)
        return F.linear(x, self.weight)

    def load(self, weight: torch.Tensor) -> None:
        self.weight.copy_(weight)
        if self.weight_t is not None:
            self.weight_t.copy_(weight.t())


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Spelled out as the reference does (in float32): on CPU this beats F.rms_norm's decomposition.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(config: object, head_dim: int) -> torch.Tensor:
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


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary on x [num_tokens, heads, head_dim]; cos/sin [num_tokens, 1, head_dim // 2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
