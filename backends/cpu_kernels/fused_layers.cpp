// Fused layer ops on the CPU: RMSNorm, SiLU(gate) * up and rotate-half rotary, one pass each over rows whose last
// dimension is contiguous. Each replaces 3-8 ATen kernels and their temporaries (backends/models/layers.py calls
// them). All math in float32; in bf16 each intermediate is rounded where the op-by-op reference in layers.py rounds
// it, so outputs match that reference up to the order of the sum of squares.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_math.h"

namespace {

using switchyard_cpu::Elem;
using switchyard_cpu::exp_nonpositive;

template <typename scalar_t>
using Raw = typename Elem<scalar_t>::raw;

template <typename scalar_t>
const Raw<scalar_t>* raw_ptr(const at::Tensor& t) { return reinterpret_cast<const Raw<scalar_t>*>(t.data_ptr()); }

template <typename scalar_t>
Raw<scalar_t>* raw_out(at::Tensor& t) { return reinterpret_cast<Raw<scalar_t>*>(t.data_ptr()); }

// Rows per parallel_for task: about 16k elements, so that a one-token decode stays on the calling thread.
inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elems, 1)); }

template <typename scalar_t>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t rows = x.size(0), d = x.size(1), stride = x.stride(0);
  using E = Elem<scalar_t>;
  const Raw<scalar_t>* xp = raw_ptr<scalar_t>(x);
  const Raw<scalar_t>* wp = raw_ptr<scalar_t>(weight);
  Raw<scalar_t>* op = raw_out<scalar_t>(out);
  at::parallel_for(0, rows, grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const Raw<scalar_t>* xr = xp + r * stride;
      Raw<scalar_t>* orow = op + r * d;
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < d; ++i) squares += E::load(xr[i]) * E::load(xr[i]);
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(d) + static_cast<float>(eps));
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) {
        orow[i] = E::store(E::load(wp[i]) * E::round(E::load(xr[i]) * inv));
      }
    }
  });
}

template <typename scalar_t>
void silu_mul_rows(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), width = out.size(1), stride = gate_up.stride(0);
  using E = Elem<scalar_t>;
  const Raw<scalar_t>* gp = raw_ptr<scalar_t>(gate_up);
  Raw<scalar_t>* op = raw_out<scalar_t>(out);
  at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const Raw<scalar_t>* gate = gp + r * stride;
      const Raw<scalar_t>* up = gate + width;
      Raw<scalar_t>* orow = op + r * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        const float g = E::load(gate[i]);
        const float e = exp_nonpositive(-std::fabs(g));  // exp(-|g|): sigmoid from either side without overflow
        const float sigmoid = g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
        orow[i] = E::store(E::round(g * sigmoid) * E::load(up[i]));
      }
    }
  });
}

template <typename scalar_t>
void rotary_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t n = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  const int64_t s_tok = x.stride(0), s_head = x.stride(1);
  using E = Elem<scalar_t>;
  const Raw<scalar_t>* xp = raw_ptr<scalar_t>(x);
  const Raw<scalar_t>* cp = raw_ptr<scalar_t>(cos);
  const Raw<scalar_t>* sp = raw_ptr<scalar_t>(sin);
  Raw<scalar_t>* op = raw_out<scalar_t>(out);
  at::parallel_for(0, n, grain(heads * 2 * half), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const Raw<scalar_t>* c = cp + t * half;
      const Raw<scalar_t>* s = sp + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        const Raw<scalar_t>* x1 = xp + t * s_tok + h * s_head;
        const Raw<scalar_t>* x2 = x1 + half;
        Raw<scalar_t>* o = op + (t * heads + h) * 2 * half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = E::load(x1[i]), b = E::load(x2[i]), ci = E::load(c[i]), si = E::load(s[i]);
          o[i] = E::store(E::round(a * ci) - E::round(b * si));
          o[i + half] = E::store(E::round(b * ci) + E::round(a * si));
        }
      }
    }
  });
}

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu(), what, " runs on CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, what, ": float32 or bfloat16");
  TORCH_CHECK(x.stride(-1) == 1, what, ": the last dimension must be contiguous");
}

// x [rows, d] (rows may be strided), weight [d] -> weight * (x / rms(x)), [rows, d] contiguous.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(), "rms_norm: x [rows, d], weight [d] of x's dtype");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == at::kFloat) rms_norm_rows<float>(x, weight, eps, out);
  else rms_norm_rows<c10::BFloat16>(x, weight, eps, out);
  return out;
}

// gate_up [rows, 2 * width] (gate first) -> silu(gate) * up, [rows, width] contiguous.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul: gate_up [rows, 2 * width]");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) silu_mul_rows<float>(gate_up, out);
  else silu_mul_rows<c10::BFloat16>(gate_up, out);
  return out;
}

// x [n, heads, head_dim] (tokens and heads may be strided), cos/sin [n, 1, head_dim / 2] contiguous ->
// rotate-half rotary, [n, heads, head_dim] contiguous.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_rows(x, "rotary");
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0, "rotary: x [n, heads, head_dim] with an even head_dim");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == x.size(0) * x.size(2) / 2 &&
                  sin.numel() == cos.numel() && cos.scalar_type() == x.scalar_type() &&
                  sin.scalar_type() == x.scalar_type(), "rotary: cos/sin [n, 1, head_dim / 2] of x's dtype");
  at::Tensor out = at::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  if (x.scalar_type() == at::kFloat) rotary_rows<float>(x, cos, sin, out);
  else rotary_rows<c10::BFloat16>(x, cos, sin, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(switchyard_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
  m.impl("rotary", c10::DispatchKey::CPU, TORCH_FN(rotary));
}
