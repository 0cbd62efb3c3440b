// Paged decode attention on the CPU: one new query token per sequence attends over that sequence's KV blocks,
// read where they lie in the cache (no gather into a padded buffer). Built at run time by backends/cpu_kernels
// with the ISA flags of the CPU it runs on; loops are written so that the compiler vectorizes them over head_dim
// and keys.
//
// Work item = (sequence, KV head): the query heads sharing that KV head read each K/V row once (GQA).
// Per tile of up to 16 keys (within one block): scores, an online softmax (running max and sum, rescaled
// accumulators), then the probability-weighted V rows are added. All sums in float32; bf16 is widened on load.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "cpu_math.h"

namespace {

using switchyard_cpu::exp_nonpositive;

constexpr int64_t kMaxGroup = 16;       // query heads per KV head
constexpr int64_t kTile = 16;           // keys per softmax step
constexpr int64_t kMaxHeadDim = 256;

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

struct Strides {
  int64_t q_token, q_head;                 // q [n, heads, head_dim], head_dim contiguous
  int64_t kv_block, kv_token, kv_head;     // k/v cache [blocks, block_size, kv_heads, head_dim]
  int64_t table_row;                       // block_tables [n, max_blocks]
};

// A vector of kLanes floats in the compiler's generic vector type: plain loops over acc[g][d] += p * v[d]
// reload and store acc for every key (gcc cannot prove acc and v apart); these keep it in registers.
constexpr int kLanes = 8;
typedef float VecF __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint16_t VecH __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t VecU __attribute__((vector_size(kLanes * sizeof(uint32_t))));

inline VecF load_vec(const float* p) {
  VecF v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline VecF load_vec(const c10::BFloat16* p) {  // bf16 is the high half of a float
  VecH h;
  std::memcpy(&h, p, sizeof(h));
  const VecU bits = __builtin_convertvector(h, VecU) << 16;
  VecF v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

// acc[g][:] += sum over the tile's keys t of scores[g][t] * v_row(t), four vectors of acc at a time.
template <typename scalar_t, int kD>
void accumulate_v(float (*acc)[kMaxHeadDim], const float (*scores)[kTile], const scalar_t* v_tile, int64_t v_stride,
                  int64_t group, int64_t d_len, int64_t tile_keys, float* row) {
  if (kD == 0 || d_len % (4 * kLanes) != 0) {  // any head_dim: the plain loops
    for (int64_t t = 0; t < tile_keys; ++t) {
      const scalar_t* src = v_tile + t * v_stride;
      for (int64_t d = 0; d < d_len; ++d) row[d] = to_float(src[d]);
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t d = 0; d < d_len; ++d) acc[g][d] += scores[g][t] * row[d];
      }
    }
    return;
  }
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t c = 0; c < d_len; c += 4 * kLanes) {
      VecF a0 = load_vec(&acc[g][c]), a1 = load_vec(&acc[g][c + kLanes]);
      VecF a2 = load_vec(&acc[g][c + 2 * kLanes]), a3 = load_vec(&acc[g][c + 3 * kLanes]);
      for (int64_t t = 0; t < tile_keys; ++t) {
        const float p = scores[g][t];
        const scalar_t* v = v_tile + t * v_stride + c;
        a0 += p * load_vec(v);
        a1 += p * load_vec(v + kLanes);
        a2 += p * load_vec(v + 2 * kLanes);
        a3 += p * load_vec(v + 3 * kLanes);
      }
      std::memcpy(&acc[g][c], &a0, sizeof(a0));
      std::memcpy(&acc[g][c + kLanes], &a1, sizeof(a1));
      std::memcpy(&acc[g][c + 2 * kLanes], &a2, sizeof(a2));
      std::memcpy(&acc[g][c + 3 * kLanes], &a3, sizeof(a3));
    }
  }
}

// Attention of the `group` query heads of KV head `kv_head` for one sequence of `num_keys` keys.
// kD > 0 fixes head_dim at compile time (fully unrolled inner loops); kD == 0 reads it from `head_dim`.
// Keys are taken kTile at a time: the softmax loops then have a fixed trip count, which gcc vectorizes
// whole (with a runtime count of 16 its cost model picks the scalar loop).
template <typename scalar_t, typename index_t, int kD>
void attend_item(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const index_t* table,
                 int64_t num_keys, int64_t kv_head, int64_t group, int64_t head_dim, int64_t block_size,
                 float scale, const Strides& s, scalar_t* out) {
  const int64_t d_len = kD > 0 ? kD : head_dim;
  alignas(64) float qf[kMaxGroup][kMaxHeadDim];
  alignas(64) float acc[kMaxGroup][kMaxHeadDim];
  alignas(64) float scores[kMaxGroup][kTile];
  alignas(64) float row[kMaxHeadDim];  // one V row widened (head_dim without a vector path)
  float running_max[kMaxGroup], running_sum[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) {
    const scalar_t* qg = q + (kv_head * group + g) * s.q_head;
    for (int64_t d = 0; d < d_len; ++d) {
      qf[g][d] = to_float(qg[d]) * scale;
      acc[g][d] = 0.0f;
    }
    running_max[g] = -std::numeric_limits<float>::infinity();
    running_sum[g] = 0.0f;
  }
  for (int64_t start = 0, tile_keys = 0; start < num_keys; start += tile_keys) {
    const int64_t block = start / block_size, first = start % block_size;
    // A tile stops at its block's end and at the last key; keys past it are never read (stale rows may hold NaN).
    tile_keys = std::min({kTile, block_size - first, num_keys - start});
    const int64_t offset = static_cast<int64_t>(table[block]) * s.kv_block + first * s.kv_token + kv_head * s.kv_head;
    const scalar_t* k_tile = k_cache + offset;
    const scalar_t* v_tile = v_cache + offset;
    for (int64_t g = 0; g < group; ++g) {
      for (int64_t t = tile_keys; t < kTile; ++t) scores[g][t] = -std::numeric_limits<float>::infinity();
    }
    for (int64_t t = 0; t < tile_keys; ++t) {
      const scalar_t* k_row = k_tile + t * s.kv_token;
      for (int64_t g = 0; g < group; ++g) {
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < d_len; ++d) dot += qf[g][d] * to_float(k_row[d]);
        scores[g][t] = dot;
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      float tile_max = running_max[g];
#pragma omp simd reduction(max : tile_max)
      for (int64_t t = 0; t < kTile; ++t) tile_max = std::max(tile_max, scores[g][t]);
      const float alpha = std::exp(running_max[g] - tile_max);  // 0 on the first tile (exp(-inf))
      float tile_sum = 0.0f;
#pragma omp simd reduction(+ : tile_sum)
      for (int64_t t = 0; t < kTile; ++t) {
        const float keep = static_cast<float>(t < tile_keys);  // padding: exp(-87) is 1e-38, not 0 (no ?: here)
        scores[g][t] = exp_nonpositive(scores[g][t] - tile_max) * keep;
        tile_sum += scores[g][t];
      }
      running_sum[g] = running_sum[g] * alpha + tile_sum;
      running_max[g] = tile_max;
      if (alpha != 1.0f) {
        for (int64_t d = 0; d < d_len; ++d) acc[g][d] *= alpha;
      }
    }
    accumulate_v<scalar_t, kD>(acc, scores, v_tile, s.kv_token, group, d_len, tile_keys, row);
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.0f / running_sum[g];
    scalar_t* og = out + (kv_head * group + g) * head_dim;
    for (int64_t d = 0; d < d_len; ++d) og[d] = static_cast<scalar_t>(acc[g][d] * inv);
  }
}

template <typename scalar_t, typename index_t, int kD>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
         const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const int64_t n = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads;
  const Strides s{q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                  block_tables.stride(0)};
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
  const index_t* table_ptr = block_tables.data_ptr<index_t>();
  const index_t* lens_ptr = seq_lens.data_ptr<index_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / kv_heads, kv_head = item % kv_heads;
      attend_item<scalar_t, index_t, kD>(q_ptr + seq * s.q_token, k_ptr, v_ptr, table_ptr + seq * s.table_row,
                                         static_cast<int64_t>(lens_ptr[seq]), kv_head, group, head_dim, block_size,
                                         static_cast<float>(scale), s, out_ptr + seq * heads * head_dim);
    }
  });
}

template <typename scalar_t, typename index_t>
void dispatch_head_dim(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  switch (q.size(2)) {
    case 64: return run<scalar_t, index_t, 64>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
    case 128: return run<scalar_t, index_t, 128>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
    default: return run<scalar_t, index_t, 0>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  }
}

template <typename scalar_t>
void dispatch_index(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  if (block_tables.scalar_type() == at::kInt) {
    dispatch_head_dim<scalar_t, int32_t>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  } else {
    dispatch_head_dim<scalar_t, int64_t>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  }
}

// q [n, heads, head_dim] (rows may be strided, head_dim contiguous); k/v caches [blocks, block_size, kv_heads,
// head_dim] contiguous; block_tables [n, >= max blocks] and seq_lens [n] (keys to attend, >= 1) of one int dtype.
at::Tensor cpu_paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "cpu_paged_decode runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous(), "bad strides");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == seq_lens.scalar_type() && block_tables.stride(1) == 1 &&
                  seq_lens.is_contiguous(), "block_tables and seq_lens: one int dtype, rows contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt || block_tables.scalar_type() == at::kLong, "int indices");
  const int64_t heads = q.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup, "unsupported GQA group");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(2) <= kMaxHeadDim, "unsupported head_dim");
  at::Tensor out = at::empty({q.size(0), heads, q.size(2)}, q.options());
  if (q.scalar_type() == at::kFloat) {
    dispatch_index<float>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    dispatch_index<c10::BFloat16>(q, k_cache, v_cache, block_tables, seq_lens, scale, out);
  } else {
    TORCH_CHECK(false, "cpu_paged_decode supports float32 and bfloat16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(switchyard_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, float scale)"
        " -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(cpu_paged_decode));
}
