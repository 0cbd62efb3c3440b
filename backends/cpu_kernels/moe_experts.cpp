// The routed experts of a sparse MLP on the CPU, in one call: sum_j w[t, j] * down[e] (silu(gate[e] x[t]) * up[e]
// x[t]) with e = ids[t, j], for x [T, H], gate_up [E, 2I, H] (gate rows first) and down [E, H, I], stored [out, in].
// backends/models/moe.py's grouped_experts is the reference (one ATen product per active expert and op).
//
// A decode step gives each expert 1-8 token rows, where one library GEMM per expert and op spends its time
// starting up and its threads waiting, and reads the weights at half the memory's speed. Here the token slots are
// counted into expert order once; then two parallel passes read each active expert's weights exactly once, in
// tiles of rows spread over the threads: (1) gate and up rows against the expert's tokens, SiLU·mul applied as
// each tile ends, (2) down rows against those products. Each tile is a register-blocked dot product of 4 weight
// rows with up to kMaxTokens token rows, accumulated in float32 vectors; bf16 weights stream half the bytes of
// float32, multiplied by vdpbf16ps with bf16 tokens where the CPU has AVX512-BF16, widened to float32 in the
// register (a shift) elsewhere. Slots whose expert id lies outside [0, E) (another
// rank's expert, under expert parallelism) add nothing. The weighted sum over each token's k slots is in float32.
// In bf16, every value is rounded where the op-by-op reference rounds it (the products, silu(gate), the SiLU·mul),
// so the two agree up to the order of the sums.
//
// moe_combine is grouped_experts' weighted sum alone, for the steps where ATen's products run the experts.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "cpu_math.h"
#include "row_dots.h"

namespace {

using switchyard_cpu::Elem;
using switchyard_cpu::exp_nonpositive;
using switchyard_cpu::kTileRows;
using switchyard_cpu::rows_times_tokens;

struct Tile {
  int64_t expert;
  int64_t row;   // first weight row of the tile
};

// Tiles of every active expert, ordered row-first, so that each thread's contiguous share of them covers every
// expert (experts with many tokens cost more per tile; decode gives them alike).
std::vector<Tile> tiles_of(const std::vector<int64_t>& active, int64_t rows) {
  std::vector<Tile> tiles;
  tiles.reserve(active.size() * ((rows + kTileRows - 1) / kTileRows));
  for (int64_t row = 0; row < rows; row += kTileRows) {
    for (int64_t e : active) tiles.push_back({e, row});
  }
  return tiles;
}

// result[t] = sum_j w[t, j] * rows[row_of[t * k + j]] over T tokens of k slots, in float32; a slot whose row is
// -1 (another rank's expert) adds nothing. float32 rows are rounded to scalar_t first, as the op-by-op reference
// stores its products; rows of scalar_t's bits are widened.
template <typename scalar_t, typename Row>
void weighted_sum(int64_t T, int64_t k, int64_t H, const float* w, const int64_t* row_of, const Row* rows,
                  typename Elem<scalar_t>::raw* result) {
  using E = Elem<scalar_t>;
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(H);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t p = row_of[t * k + j];
        if (p < 0) continue;
        const float wj = w[t * k + j];
        const Row* o = rows + p * H;
        if constexpr (std::is_same_v<Row, float>) {
#pragma omp simd
          for (int64_t i = 0; i < H; ++i) sum[i] += wj * E::round(o[i]);
        } else {
#pragma omp simd
          for (int64_t i = 0; i < H; ++i) sum[i] += wj * E::load(o[i]);
        }
      }
      typename E::raw* r = result + t * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) r[i] = E::store(sum[i]);
    }
  });
}

template <typename scalar_t>
void experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, const at::Tensor& gate_up,
             const at::Tensor& down, at::Tensor& result) {
  using E = Elem<scalar_t>;
  using Raw = typename E::raw;
  const int64_t T = x.size(0), H = x.size(1), k = ids.size(1);
  const int64_t num_experts = gate_up.size(0), I = down.size(2);
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* w = weights.data_ptr<float>();
  const Raw* xp = reinterpret_cast<const Raw*>(x.data_ptr());
  const Raw* gu = reinterpret_cast<const Raw*>(gate_up.data_ptr());
  const Raw* dn = reinterpret_cast<const Raw*>(down.data_ptr());
  Raw* rp = reinterpret_cast<Raw*>(result.data_ptr());

  // The slots in expert order: sorted[start[e] .. start[e + 1]) are expert e's; position[slot] is where a slot
  // went, -1 for another rank's expert.
  std::vector<int64_t> start(num_experts + 1, 0), position(T * k, -1);
  for (int64_t s = 0; s < T * k; ++s) {
    if (id[s] >= 0 && id[s] < num_experts) ++start[id[s] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) start[e + 1] += start[e];
  const int64_t slots = start[num_experts];
  std::vector<int64_t> fill(start.begin(), start.end() - 1), token(slots);
  for (int64_t s = 0; s < T * k; ++s) {
    if (id[s] >= 0 && id[s] < num_experts) {
      position[s] = fill[id[s]]++;
      token[position[s]] = s / k;
    }
  }
  std::vector<int64_t> active;
  for (int64_t e = 0; e < num_experts; ++e) {
    if (start[e + 1] > start[e]) active.push_back(e);
  }

  // The kernels read token rows through pointers (a token's row per slot, in slot order): bf16 rows as they lie
  // where the CPU multiplies bf16 pairs (kDotBf16), the tokens widened to float32 once otherwise. The SiLU·mul
  // products (rounded to bf16 in bf16, as the reference rounds them) are kept in the same type X.
  constexpr bool kBf16Rows = switchyard_cpu::kDotBf16 && sizeof(Raw) == 2;
  using X = std::conditional_t<kBf16Rows, uint16_t, float>;
  std::unique_ptr<float[]> xf;
  const X* x_rows;
  if constexpr (kBf16Rows) {
    x_rows = xp;
  } else {
    xf.reset(new float[T * H]);   // left uninitialised: every element is written
    at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin * H; i < end * H; ++i) xf[i] = E::load(xp[i]);
    });
    x_rows = xf.get();
  }
  std::vector<const X*> rows(slots);
  for (int64_t s = 0; s < slots; ++s) rows[s] = x_rows + token[s] * H;

  const std::unique_ptr<X[]> hidden(new X[slots * I]);
  const std::unique_ptr<float[]> out(new float[slots * H]);
  const std::vector<Tile> first = tiles_of(active, I), second = tiles_of(active, H);
  // (1) h[slot, j] = silu(gate[e, j] . x) * (up[e, j] . x), a tile of j per task.
  at::parallel_for(0, static_cast<int64_t>(first.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> products;
    for (int64_t t = begin; t < end; ++t) {
      const Tile tile = first[t];
      const int64_t s0 = start[tile.expert], M = start[tile.expert + 1] - s0;
      const int64_t n = std::min(kTileRows, I - tile.row);
      products.resize(2 * n * M);   // [M, 2n]: n gate then n up products per token
      const Raw* wg = gu + (tile.expert * 2 * I + tile.row) * H;
      rows_times_tokens(wg, n, H, rows.data() + s0, M, products.data(), 2 * n);
      rows_times_tokens(wg + I * H, n, H, rows.data() + s0, M, products.data() + n, 2 * n);
      for (int64_t m = 0; m < M; ++m) {
        const float* g = products.data() + m * 2 * n;
        X* h = hidden.get() + (s0 + m) * I + tile.row;
        for (int64_t j = 0; j < n; ++j) {
          const float gj = E::round(g[j]), uj = E::round(g[n + j]);
          const float e = exp_nonpositive(-std::fabs(gj));
          const float sigmoid = gj >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
          if constexpr (kBf16Rows) h[j] = E::store(E::round(gj * sigmoid) * uj);
          else h[j] = E::round(E::round(gj * sigmoid) * uj);
        }
      }
    }
  });
  // (2) out[slot, i] = down[e, i] . h[slot], a tile of i per task.
  at::parallel_for(0, static_cast<int64_t>(second.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<const X*> hrows;
    for (int64_t t = begin; t < end; ++t) {
      const Tile tile = second[t];
      const int64_t s0 = start[tile.expert], M = start[tile.expert + 1] - s0;
      const int64_t n = std::min(kTileRows, H - tile.row);
      hrows.resize(M);
      for (int64_t m = 0; m < M; ++m) hrows[m] = hidden.get() + (s0 + m) * I;
      rows_times_tokens(dn + (tile.expert * H + tile.row) * I, n, I, hrows.data(), M,
                        out.get() + s0 * H + tile.row, H);
    }
  });
  // (3) result[t] = sum_j w[t, j] * out[slot (t, j)], in float32.
  weighted_sum<scalar_t>(T, k, H, w, position.data(), out.get(), rp);
}

// x [T, H], topk_ids [T, k] int64, topk_weights [T, k] float32, gate_up [E, 2I, H], down [E, H, I] of x's dtype
// (float32 or bfloat16), all contiguous -> the routed output [T, H] in x's dtype.
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                       const at::Tensor& gate_up, const at::Tensor& down) {
  for (const at::Tensor* t : {&x, &topk_ids, &topk_weights, &gate_up, &down}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(), "moe_experts: contiguous CPU tensors");
  }
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "moe_experts: float32 or bfloat16");
  TORCH_CHECK(gate_up.scalar_type() == x.scalar_type() && down.scalar_type() == x.scalar_type(),
              "moe_experts: the experts in x's dtype");
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong && topk_weights.scalar_type() == at::kFloat,
              "moe_experts: int64 ids and float32 weights");
  TORCH_CHECK(x.dim() == 2 && topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0) &&
                  topk_weights.sizes() == topk_ids.sizes(), "moe_experts: x [T, H], ids and weights [T, k]");
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && down.size(0) == gate_up.size(0) &&
                  gate_up.size(2) == x.size(1) && down.size(1) == x.size(1) && gate_up.size(1) == 2 * down.size(2),
              "moe_experts: gate_up [E, 2I, H], down [E, H, I]");
  at::Tensor result = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == at::kFloat) experts<float>(x, topk_ids, topk_weights, gate_up, down, result);
  else experts<c10::BFloat16>(x, topk_ids, topk_weights, gate_up, down, result);
  return result;
}

// grouped_experts' last step (backends/models/moe.py), where ATen ran the products: result[t] = sum_j w[t, j] *
// out[p] over the row p that holds slot t * k + j, in float32, for out [T * k, H] in expert order (order[p]: the
// slot of row p, a permutation of 0 .. T * k - 1). One pass over out, in place of un-permuting it, widening that
// copy to float32 and a batched product (three copies of the rows, in fresh memory).
template <typename scalar_t>
void combine(const at::Tensor& out, const at::Tensor& order, const at::Tensor& weights, at::Tensor& result) {
  using E = Elem<scalar_t>;
  using Raw = typename E::raw;
  const int64_t T = weights.size(0), k = weights.size(1), H = out.size(1);
  const int64_t* slot_of = order.data_ptr<int64_t>();
  const float* w = weights.data_ptr<float>();
  const Raw* op = reinterpret_cast<const Raw*>(out.data_ptr());
  Raw* rp = reinterpret_cast<Raw*>(result.data_ptr());
  std::vector<int64_t> row_of(T * k, -1);
  for (int64_t p = 0; p < T * k; ++p) {
    TORCH_CHECK(slot_of[p] >= 0 && slot_of[p] < T * k, "moe_combine: order is not a permutation of the slots");
    row_of[slot_of[p]] = p;
  }
  weighted_sum<scalar_t>(T, k, H, w, row_of.data(), op, rp);
}

// out [T * k, H] float32 or bfloat16, order [T * k] int64 (a permutation), topk_weights [T, k] float32, all
// contiguous -> [T, H] in out's dtype.
at::Tensor moe_combine(const at::Tensor& out, const at::Tensor& order, const at::Tensor& topk_weights) {
  for (const at::Tensor* t : {&out, &order, &topk_weights}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(), "moe_combine: contiguous CPU tensors");
  }
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16,
              "moe_combine: float32 or bfloat16");
  TORCH_CHECK(order.scalar_type() == at::kLong && topk_weights.scalar_type() == at::kFloat,
              "moe_combine: int64 order and float32 weights");
  TORCH_CHECK(out.dim() == 2 && topk_weights.dim() == 2 && order.dim() == 1 &&
                  order.size(0) == out.size(0) && out.size(0) == topk_weights.numel(),
              "moe_combine: out [T * k, H], order [T * k], weights [T, k]");
  at::Tensor result = at::empty({topk_weights.size(0), out.size(1)}, out.options());
  if (out.scalar_type() == at::kFloat) combine<float>(out, order, topk_weights, result);
  else combine<c10::BFloat16>(out, order, topk_weights, result);
  return result;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(switchyard_cpu, m) {
  m.def("moe_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor gate_up, Tensor down) -> Tensor");
  m.impl("moe_experts", c10::DispatchKey::CPU, TORCH_FN(moe_experts));
  m.def("moe_combine(Tensor out, Tensor order, Tensor topk_weights) -> Tensor");
  m.impl("moe_combine", c10::DispatchKey::CPU, TORCH_FN(moe_combine));
}
