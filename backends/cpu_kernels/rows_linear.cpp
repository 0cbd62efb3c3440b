// x W^T (+ bias) for a plain [out, in] weight on the CPU where no library product reads it well: bf16 weights on a
// CPU without native bf16 (AVX2), where ATen's bf16 matmul converts in software (a 2048 x 32000 head at 8 rows
// read its weights at 1.7 GB/s on the AVX2 EPYC, at 32 rows at 0.4). Tiles of kTileRows output columns are spread
// over the threads; each is row_dots.h's register-blocked dot products against every token row, the weights read
// once per block of tokens (and widened once per group of rows when there are many tokens). Accumulated in float32,
// the bias added in float32, rounded once to x's dtype, as ATen's bf16 product rounds.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "cpu_math.h"
#include "row_dots.h"

namespace {

using switchyard_cpu::Elem;
using switchyard_cpu::kTileRows;
using switchyard_cpu::rows_times_tokens;

template <typename scalar_t>
void linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, at::Tensor& out) {
  using E = Elem<scalar_t>;
  using Raw = typename E::raw;
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const Raw* xp = reinterpret_cast<const Raw*>(x.data_ptr());
  const Raw* wp = reinterpret_cast<const Raw*>(weight.data_ptr());
  const Raw* bp = bias ? reinterpret_cast<const Raw*>(bias->data_ptr()) : nullptr;
  Raw* op = reinterpret_cast<Raw*>(out.data_ptr());
  const std::unique_ptr<float[]> xf(new float[M * K]);   // the token rows in float32 once
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * K; i < end * K; ++i) xf[i] = E::load(xp[i]);
  });
  std::vector<const float*> rows(M);
  for (int64_t m = 0; m < M; ++m) rows[m] = xf.get() + m * K;
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> products(M * kTileRows);   // [M, n]
    for (int64_t t = begin; t < end; ++t) {
      const int64_t first = t * kTileRows, n = std::min(kTileRows, N - first);
      rows_times_tokens(wp + first * K, n, K, rows.data(), M, products.data(), n);
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t j = 0; j < n; ++j) {
          const float b = bp != nullptr ? E::load(bp[first + j]) : 0.0f;
          op[m * N + first + j] = E::store(products[m * n + j] + b);
        }
      }
    }
  });
}

// x [M, K], weight [N, K] (and bias [N]) of one dtype, float32 or bfloat16, contiguous -> [M, N] in that dtype.
at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && x.is_contiguous() && weight.is_contiguous(),
              "rows_linear: contiguous CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "rows_linear: float32 or bfloat16");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rows_linear: the weight in x's dtype");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.size(1) == x.size(1), "rows_linear: x [M, K], weight [N, K]");
  if (bias) {
    TORCH_CHECK(bias->device().is_cpu() && bias->is_contiguous() && bias->scalar_type() == x.scalar_type() &&
                    bias->dim() == 1 && bias->size(0) == weight.size(0), "rows_linear: bias [N] of x's dtype");
  }
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  if (x.scalar_type() == at::kFloat) linear<float>(x, weight, bias, out);
  else linear<c10::BFloat16>(x, weight, bias, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(switchyard_cpu, m) {
  m.def("rows_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("rows_linear", c10::DispatchKey::CPU, TORCH_FN(rows_linear));
}
