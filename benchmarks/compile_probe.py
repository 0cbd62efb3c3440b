"""Would `torch.compile` speed up the CPU decode step? Times the model runner's decode step eager and
with the whole model forward compiled by inductor (dynamic token count), in one run.

The compiled variant wraps the two things inductor cannot see through as opaque custom ops: the
oneDNN-packed matmul (its weight is in a blocked layout inductor cannot lower) and the paged attention
(its per-step context is Python). Everything else (RMSNorm, rotary, SiLU·mul, residual adds) is left to
inductor to fuse. A probe for issue 18, not a serving path: it patches the model in place.

    .venv/bin/python benchmarks/compile_probe.py [--threads 2] [--context 300]
"""
from __future__ import annotations

import argparse
import time

import torch

from backends.attention.base import AttentionContext
from backends.models import llama
from backends.models.kernels import rotary
from backends.worker.loader import resolve_model
from backends.worker.model_runner import ModelRunner
from tools.bench_runner import bench_decode

_CONTEXT: list[AttentionContext] = []


@torch.library.custom_op("switchyard_probe::packed_linear", mutates_args=())
def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@_packed_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], packed.shape[0]))


@torch.library.custom_op("switchyard_probe::attention", mutates_args=())
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return _CONTEXT[-1](layer, q, k, v)


@_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return q.new_empty(q.shape)


def _attention_forward(self: llama.LlamaAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       attn: AttentionContext | None) -> torch.Tensor:
    num_tokens, heads, kv_heads, head_dim = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
    qkv = self.qkv_proj(x)
    qk = qkv[:, :(heads + kv_heads) * head_dim].view(num_tokens, heads + kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(num_tokens, kv_heads, head_dim)
    qk = rotary.apply_rotary(qk, cos, sin)
    out = _attention(qk[:, :heads].contiguous(), qk[:, heads:].contiguous(), v.contiguous(), self.layer)
    return self.o_proj(out.reshape(num_tokens, heads * head_dim))


def compile_in_place(runner: ModelRunner) -> None:
    runner.kernels.packed_linear = _packed_linear   # type: ignore[method-assign]
    llama.LlamaAttention.forward = _attention_forward  # type: ignore[method-assign]
    eager_forward = runner.model.forward
    compiled = torch.compile(lambda ids, pos: eager_forward(ids, pos, None), dynamic=True)

    def forward(ids: torch.Tensor, pos: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        _CONTEXT[:] = [attn]
        return compiled(ids, pos)
    runner.model.forward = forward                  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model("smollm2")
    results: dict[str, list[float]] = {}
    for variant in ("eager", "compiled"):
        runner = ModelRunner(model_dir, dtype=torch.float32, device="cpu", num_blocks=None, attention_backend=None)
        start = time.perf_counter()
        if variant == "compiled":
            compile_in_place(runner)
        results[variant] = [bench_decode(runner, n, args.context, 20)[0] * 1e3 for n in (1, 8, 32)]
        print(f"# {variant}: {time.perf_counter() - start:.0f} s including warm-up and compilation", flush=True)
    print(f"\n| decode step, {args.context} context | eager ms | compiled ms | compiled / eager |")
    print("|---|---|---|---|")
    for i, n in enumerate((1, 8, 32)):
        e, c = results["eager"][i], results["compiled"][i]
        print(f"| {n} seqs | {e:.1f} | {c:.1f} | {c / e:.2f} |")


if __name__ == "__main__":
    main()
