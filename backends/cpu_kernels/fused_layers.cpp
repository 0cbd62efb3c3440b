// Fused layer ops on the CPU: RMSNorm (alone, or after the residual add), SiLU(gate) * up, rotate-half rotary, and
// rotary with the K/V cache writes (rotary_store), one pass each over rows whose last dimension is contiguous. Each
// replaces 2-8 ATen kernels and their temporaries (backends/models/kernels/cpu.py calls them). All math in float32;
// in bf16 each intermediate is rounded where the op-by-op reference in kernels/base.py rounds it, so outputs match
// that reference up to the order of the sum of squares.
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

// One row's RMSNorm once its sum of squares is known: weight * (x / rms(x)) into orow.
template <typename scalar_t>
inline void scale_row(const Raw<scalar_t>* xr, const Raw<scalar_t>* wp, int64_t d, float squares, double eps,
                      Raw<scalar_t>* orow) {
  using E = Elem<scalar_t>;
  const float inv = 1.0f / std::sqrt(squares / static_cast<float>(d) + static_cast<float>(eps));
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) orow[i] = E::store(E::load(wp[i]) * E::round(E::load(xr[i]) * inv));
}

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
      scale_row<scalar_t>(xr, wp, d, squares, eps, orow);
    }
  });
}

// x += residual (rounded to the dtype, as ATen's add rounds it), then RMSNorm of that sum into out: the residual
// add and the next layer's norm in one pass over the row where they took two.
template <typename scalar_t>
void add_rms_norm_rows(at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                       at::Tensor& out) {
  const int64_t rows = x.size(0), d = x.size(1), r_stride = residual.stride(0);
  using E = Elem<scalar_t>;
  Raw<scalar_t>* xp = raw_out<scalar_t>(x);
  const Raw<scalar_t>* rp = raw_ptr<scalar_t>(residual);
  const Raw<scalar_t>* wp = raw_ptr<scalar_t>(weight);
  Raw<scalar_t>* op = raw_out<scalar_t>(out);
  at::parallel_for(0, rows, grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      Raw<scalar_t>* xr = xp + r * d;
      const Raw<scalar_t>* rr = rp + r * r_stride;
      Raw<scalar_t>* orow = op + r * d;
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < d; ++i) {
        const float total = E::round(E::load(xr[i]) + E::load(rr[i]));
        xr[i] = E::store(total);
        squares += total * total;
      }
      scale_row<scalar_t>(xr, wp, d, squares, eps, orow);
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

// One head of rotate-half rotary: x (2 * half values) rotated by c, s (half values each) into o.
template <typename scalar_t>
inline void rotate_head(const Raw<scalar_t>* x, const Raw<scalar_t>* c, const Raw<scalar_t>* s, int64_t half,
                        Raw<scalar_t>* o) {
  using E = Elem<scalar_t>;
  const Raw<scalar_t>* x2 = x + half;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = E::load(x[i]), b = E::load(x2[i]), ci = E::load(c[i]), si = E::load(s[i]);
    o[i] = E::store(E::round(a * ci) - E::round(b * si));
    o[i + half] = E::store(E::round(b * ci) + E::round(a * si));
  }
}

template <typename scalar_t>
void rotary_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t n = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  const int64_t s_tok = x.stride(0), s_head = x.stride(1);
  const Raw<scalar_t>* xp = raw_ptr<scalar_t>(x);
  const Raw<scalar_t>* cp = raw_ptr<scalar_t>(cos);
  const Raw<scalar_t>* sp = raw_ptr<scalar_t>(sin);
  Raw<scalar_t>* op = raw_out<scalar_t>(out);
  at::parallel_for(0, n, grain(heads * 2 * half), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        rotate_head<scalar_t>(xp + t * s_tok + h * s_head, cp + t * half, sp + t * half, half,
                              op + (t * heads + h) * 2 * half);
      }
    }
  });
}

// Per token: q's heads rotated into q_out, k's heads rotated into the K cache at the token's slot, v copied into
// the V cache there. Caches [num_blocks, block_size, kv_heads, head_dim], each head's head_dim contiguous.
template <typename scalar_t>
void rotary_store_rows(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                       int64_t kv_heads, at::Tensor& k_cache, at::Tensor& v_cache, const int64_t* slots,
                       at::Tensor& q_out) {
  const int64_t n = qkv.size(0), head_dim = qkv.size(1) / (heads + 2 * kv_heads), half = head_dim / 2;
  const int64_t s_tok = qkv.stride(0), block_size = k_cache.size(1);
  const Raw<scalar_t>* xp = raw_ptr<scalar_t>(qkv);
  const Raw<scalar_t>* cp = raw_ptr<scalar_t>(cos);
  const Raw<scalar_t>* sp = raw_ptr<scalar_t>(sin);
  Raw<scalar_t>* qp = raw_out<scalar_t>(q_out);
  Raw<scalar_t>* kp = raw_out<scalar_t>(k_cache);
  Raw<scalar_t>* vp = raw_out<scalar_t>(v_cache);
  at::parallel_for(0, n, grain((heads + 2 * kv_heads) * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const Raw<scalar_t>* row = xp + t * s_tok;
      const Raw<scalar_t>* c = cp + t * half;
      const Raw<scalar_t>* s = sp + t * half;
      const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
      Raw<scalar_t>* k_slot = kp + block * k_cache.stride(0) + offset * k_cache.stride(1);
      Raw<scalar_t>* v_slot = vp + block * v_cache.stride(0) + offset * v_cache.stride(1);
      for (int64_t h = 0; h < heads; ++h) {
        rotate_head<scalar_t>(row + h * head_dim, c, s, half, qp + (t * heads + h) * head_dim);
      }
      for (int64_t h = 0; h < kv_heads; ++h) {
        rotate_head<scalar_t>(row + (heads + h) * head_dim, c, s, half, k_slot + h * k_cache.stride(2));
        std::memcpy(v_slot + h * v_cache.stride(2), row + (heads + kv_heads + h) * head_dim,
                    head_dim * sizeof(Raw<scalar_t>));
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

// x [rows, d] contiguous, residual [rows, d] (rows may be strided), weight [d] -> x + residual written over x,
// and weight * (sum / rms(sum)), [rows, d] contiguous.
at::Tensor add_rms_norm(at::Tensor x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm");
  check_rows(residual, "add_rms_norm");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.sizes() == x.sizes() &&
                  residual.scalar_type() == x.scalar_type() && weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              "add_rms_norm: x [rows, d] contiguous, residual [rows, d] and weight [d] of x's dtype");
  TORCH_CHECK(x.data_ptr() != residual.data_ptr(), "add_rms_norm: x and residual alias");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == at::kFloat) add_rms_norm_rows<float>(x, residual, weight, eps, out);
  else add_rms_norm_rows<c10::BFloat16>(x, residual, weight, eps, out);
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

// qkv [n, (heads + 2 * kv_heads) * head_dim] (rows may be strided), cos/sin [n, 1, head_dim / 2] contiguous,
// k_cache/v_cache [num_blocks, block_size, kv_heads, head_dim] of qkv's dtype, slot_mapping [n] int64 (block *
// block_size + offset) -> the rotated q [n, heads, head_dim], contiguous; the rotated k and the v are written
// at each token's slot. One pass in place of rotary, a slice and two index_copy_ calls.
at::Tensor rotary_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                        int64_t kv_heads, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping) {
  check_rows(qkv, "rotary_store");
  TORCH_CHECK(qkv.dim() == 2 && heads > 0 && kv_heads > 0 && qkv.size(1) % (heads + 2 * kv_heads) == 0,
              "rotary_store: qkv [n, (heads + 2 * kv_heads) * head_dim]");
  const int64_t head_dim = qkv.size(1) / (heads + 2 * kv_heads), n = qkv.size(0);
  TORCH_CHECK(head_dim % 2 == 0, "rotary_store: an even head_dim");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == n * head_dim / 2 &&
                  sin.numel() == cos.numel() && cos.scalar_type() == qkv.scalar_type() &&
                  sin.scalar_type() == qkv.scalar_type(), "rotary_store: cos/sin [n, 1, head_dim / 2] of qkv's dtype");
  for (const at::Tensor* cache : {&k_cache, &v_cache}) {
    TORCH_CHECK(cache->device().is_cpu() && cache->dim() == 4 && cache->size(2) == kv_heads &&
                    cache->size(3) == head_dim && cache->stride(3) == 1 && cache->sizes() == k_cache.sizes() &&
                    cache->scalar_type() == qkv.scalar_type(),
                "rotary_store: caches [num_blocks, block_size, kv_heads, head_dim] of qkv's dtype");
  }
  TORCH_CHECK(slot_mapping.device().is_cpu() && slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == n, "rotary_store: slot_mapping [n] int64");
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "rotary_store: slot ", sp[t], " outside the cache's ", num_slots);
  }
  at::Tensor q = at::empty({n, heads, head_dim}, qkv.options());
  if (qkv.scalar_type() == at::kFloat) {
    rotary_store_rows<float>(qkv, cos, sin, heads, kv_heads, k_cache, v_cache, sp, q);
  } else {
    rotary_store_rows<c10::BFloat16>(qkv, cos, sin, heads, kv_heads, k_cache, v_cache, sp, q);
  }
  return q;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(switchyard_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("rotary_store(Tensor qkv, Tensor cos, Tensor sin, int heads, int kv_heads, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slot_mapping) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
  m.impl("rotary", c10::DispatchKey::CPU, TORCH_FN(rotary));
  m.impl("rotary_store", c10::DispatchKey::CPU, TORCH_FN(rotary_store));
}
