// Paged decode attention on the CPU: one new query token per sequence (or a few: a chunk of speculative tokens to
// verify, causal among themselves) attends over that sequence's KV blocks, read where they lie in the cache (no
// gather into a padded buffer). Built at run time by backends/cpu_kernels with the ISA flags of the CPU it runs on;
// loops are written so that the compiler vectorizes them over head_dim and keys.
//
// Work item = (sequence, KV head): the query rows sharing that KV head (its query heads, for each new token) read
// each K/V row once (GQA).
// Per span of up to 256 keys (tiles of up to 16 keys, each within one block): all scores first, then one softmax
// step over the span (one max, one rescale of the accumulators), then the probability-weighted V rows are added with
// the accumulators held in registers across the span. All sums in float32; bf16 is widened on load.
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
#include <optional>
#include <utility>
#include <type_traits>

#include "cpu_math.h"

namespace {

using switchyard_cpu::exp_nonpositive;

constexpr int64_t kMaxRows = 64;         // query rows per work item (query tokens x query heads of one KV head)
constexpr int64_t kMaxRowElems = 4096;   // ... times head_dim: the work item's stack buffers (16 KiB each)
constexpr int64_t kTile = 16;            // keys a score step reduces at once, all within one block
constexpr int64_t kSpan = 256;           // keys per softmax step: a span's scores, then one max and sum per row
constexpr int64_t kScoreStride = kSpan + kTile;  // a row's span of scores (a span's last tile writes kTile)
constexpr int64_t kMaxHeadDim = 256;

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

struct Strides {
  int64_t q_token, q_head;                 // q [tokens, heads, head_dim], head_dim contiguous
  int64_t out_token;                       // out [tokens, heads, head_dim], contiguous: heads * head_dim
  int64_t kv_block, kv_token, kv_head;     // k/v cache [blocks, block_size, kv_heads, head_dim]
  int64_t table_row;                       // block_tables [n, max_blocks]
};

using switchyard_cpu::kLanes;
using switchyard_cpu::load_vec;
using switchyard_cpu::VecF;

// Asks for `count` rows of `elems` elements, `stride` elements apart, to be brought into the cache: a tile's keys lie
// in a block the hardware prefetcher cannot foresee (blocks are scattered), and a decode step reads them once.
template <int kLocality = 3, typename scalar_t>
inline void prefetch_rows(const scalar_t* first, int64_t stride, int64_t count, int64_t elems) {
  constexpr int64_t kLine = 64 / sizeof(scalar_t);
  for (int64_t t = 0; t < count; ++t) {
    for (int64_t e = 0; e < elems; e += kLine) __builtin_prefetch(first + t * stride + e, 0, kLocality);
  }
}

// Sixteen keys' dot-product vectors (p[t]: lane-wise partial sums of q . k_t) reduced to their sixteen sums, key t in
// lane t of the result (two vectors of 8 with 8 lanes): each level adds the two halves of every vector, packing two
// vectors' halves into one, so 15 shuffle-and-add steps replace 16 horizontal sums.
#ifdef __AVX512F__
inline VecF pair_halves(VecF a, VecF b) {  // lanes 0-7: a's halves summed, 8-15: b's
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
inline VecF pair_quarters(VecF a, VecF b) {  // a, b hold two keys' 8 partials each: out four keys' 4 partials
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
         __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
inline VecF pair_eighths(VecF a, VecF b) {  // four keys' 4 partials each: out eight keys' 2 partials
  return __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
         __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
}
inline VecF pair_lanes(VecF a, VecF b) {  // eight keys' 2 partials each: out sixteen keys' sums
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
inline void reduce_keys(VecF (&p)[kTile], float* out) {
  VecF q[8], r[4];
  for (int i = 0; i < 8; ++i) q[i] = pair_halves(p[2 * i], p[2 * i + 1]);
  for (int i = 0; i < 4; ++i) r[i] = pair_quarters(q[2 * i], q[2 * i + 1]);
  const VecF all = pair_lanes(pair_eighths(r[0], r[1]), pair_eighths(r[2], r[3]));
  std::memcpy(out, &all, sizeof(all));
}
#else
inline VecF pair_halves(VecF a, VecF b) {  // lanes 0-3: a's halves summed, 4-7: b's
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
}
inline VecF pair_quarters(VecF a, VecF b) {  // two keys' 4 partials each: out four keys' 2 partials
  return __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13) + __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15);
}
inline VecF pair_lanes(VecF a, VecF b) {  // four keys' 2 partials each: out eight keys' sums
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14) + __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
}
inline void reduce_keys(VecF (&p)[kTile], float* out) {
  for (int half = 0; half < 2; ++half) {
    const VecF* h = p + 8 * half;
    const VecF all = pair_lanes(pair_quarters(pair_halves(h[0], h[1]), pair_halves(h[2], h[3])),
                                pair_quarters(pair_halves(h[4], h[5]), pair_halves(h[6], h[7])));
    std::memcpy(out + 8 * half, &all, sizeof(all));
  }
}
#endif

// Scores of the tile's keys for every row, written to scores + r * stride + 0 .. kTile - 1 (row r = q row r: its q
// widened and scaled already, qf, kD floats apart); keys past tile_keys are not read and score 0 (not used after).
template <typename scalar_t, int kD>
void tile_scores(const float* qf, const scalar_t* k_tile, int64_t k_stride, int64_t rows, int64_t tile_keys,
                 float* scores, int64_t stride) {
  constexpr int kVecs = kD / kLanes;
  for (int64_t r = 0; r < rows; ++r) {
    VecF q[kVecs];
    for (int c = 0; c < kVecs; ++c) q[c] = load_vec(qf + r * kD + c * kLanes);
    VecF p[kTile];
    for (int64_t t = 0; t < kTile; ++t) {
      if (t >= tile_keys) {
        p[t] = VecF{};
        continue;
      }
      const scalar_t* k = k_tile + t * k_stride;
      VecF sum = q[0] * load_vec(k);
      for (int c = 1; c < kVecs; ++c) sum += q[c] * load_vec(k + c * kLanes);
      p[t] = sum;
    }
    reduce_keys(p, scores + r * stride);
  }
}

#ifdef __AVX512BF16__
// tile_scores for bf16 caches where the CPU has AVX512-BF16: vdpbf16ps multiplies the bf16 q and K rows as they lie
// (32 pairs an instruction, products exact in float32, sums in float32), so K is not widened and a key takes half
// the multiply instructions; scale is applied to the sums. qb: the q rows' bf16 bits, kD apart.
template <int kD>
void tile_scores_bf16(const uint16_t* qb, const c10::BFloat16* k_tile, int64_t k_stride, int64_t rows,
                      int64_t tile_keys, float scale, float* scores, int64_t stride) {
  constexpr int kVecs = kD / 32;
  for (int64_t r = 0; r < rows; ++r) {
    __m512bh q[kVecs];
    for (int c = 0; c < kVecs; ++c) q[c] = (__m512bh)_mm512_loadu_si512(qb + r * kD + 32 * c);
    VecF p[kTile];
    for (int64_t t = 0; t < kTile; ++t) {
      if (t >= tile_keys) {
        p[t] = VecF{};
        continue;
      }
      const uint16_t* k = reinterpret_cast<const uint16_t*>(k_tile + t * k_stride);
      __m512 sum = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], (__m512bh)_mm512_loadu_si512(k));
      for (int c = 1; c < kVecs; ++c) sum = _mm512_dpbf16_ps(sum, q[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
      p[t] = reinterpret_cast<const VecF&>(sum);
    }
    float* out = scores + r * stride;
    reduce_keys(p, out);
    for (int64_t t = 0; t < kTile; ++t) out[t] *= scale;
  }
}
#endif

// A span's tiles: where each tile's rows start in the cache (elements) and how many keys it has. Tiles lie
// back to back in the span: tile i starts at key sum(len[0 .. i - 1]) of it.
struct SpanTiles {
  int64_t count = 0;
  int64_t offset[kSpan];
  int64_t len[kSpan];
};

// Up to kGroup query rows at a time keep their accumulators in registers over the whole span, kCols vectors of
// head_dim at a time, and each V vector is widened once for all of them (GQA: a KV head's query heads share its
// rows). kCount rows: a compile-time count, so that the accumulators are registers, not a stack array.
constexpr int64_t kGroup = 4;
constexpr int kCols = kLanes == 16 ? 4 : 2;  // 16 + 4 of AVX-512's 32 registers; 8 + 2 of AVX2's 16

// acc rows first .. first + kCount - 1 += sum over the span's keys j of p[r][j] * v_j (p: scores rows, stride
// floats apart, already turned into softmax weights).
template <typename scalar_t, int kD, int kCount>
void span_values(float* acc, const float* p, int64_t stride, const scalar_t* v_cache, const SpanTiles& tiles,
                 int64_t v_stride, int64_t first) {
  static_assert(kD % (kCols * kLanes) == 0, "head_dim in whole column groups");
  for (int c = 0; c < kD; c += kCols * kLanes) {
    VecF a[kCount][kCols];
    for (int g = 0; g < kCount; ++g) {
      for (int j = 0; j < kCols; ++j) a[g][j] = load_vec(acc + (first + g) * kD + c + j * kLanes);
    }
    for (int64_t i = 0, pos = 0; i < tiles.count; pos += tiles.len[i], ++i) {
      const scalar_t* v_tile = v_cache + tiles.offset[i] + c;
      const float* w = p + first * stride + pos;
      for (int64_t t = 0; t < tiles.len[i]; ++t) {
        VecF v[kCols];
        for (int j = 0; j < kCols; ++j) v[j] = load_vec(v_tile + t * v_stride + j * kLanes);
        for (int g = 0; g < kCount; ++g) {
          const float weight = w[g * stride + t];
          for (int j = 0; j < kCols; ++j) a[g][j] += weight * v[j];
        }
      }
    }
    for (int g = 0; g < kCount; ++g) {
      for (int j = 0; j < kCols; ++j) std::memcpy(acc + (first + g) * kD + c + j * kLanes, &a[g][j], sizeof(VecF));
    }
  }
}

// acc row r += sum over the span's keys j of p[r][j] * v_row(j), for a head_dim without the register-tiled path
// (span_values): each V row widened once into `row`; acc rows are d_len floats apart.
template <typename scalar_t>
void accumulate_v(float* acc, const float* p, int64_t stride, const scalar_t* v_cache, const SpanTiles& tiles,
                  int64_t v_stride, int64_t rows, int64_t d_len, float* row) {
  for (int64_t i = 0, pos = 0; i < tiles.count; pos += tiles.len[i], ++i) {
    for (int64_t t = 0; t < tiles.len[i]; ++t) {
      const scalar_t* src = v_cache + tiles.offset[i] + t * v_stride;
      for (int64_t d = 0; d < d_len; ++d) row[d] = to_float(src[d]);
      for (int64_t r = 0; r < rows; ++r) {
        const float weight = p[r * stride + pos + t];
        float* acc_r = acc + r * d_len;
        for (int64_t d = 0; d < d_len; ++d) acc_r[d] += weight * row[d];
      }
    }
  }
}

// Attention of one sequence's `q_len` newest tokens (the last q_len of its `num_keys` keys), for the `group` query
// heads of KV head `kv_head`: rows = q_len * group query rows, row r = (token r / group, head r % group), each K/V
// row read once for all of them. Token j sees keys 0 .. num_keys - q_len + j (causal within the chunk).
// kD > 0 fixes head_dim at compile time (fully unrolled inner loops); kD == 0 reads it from `head_dim`.
// kChunk false: one token (q_len 1) that sees every key, with no per-row masking.
// Keys are taken a span (up to kSpan) at a time: first every key's scores, tile by tile (a tile: up to kTile keys
// within one block); then each row's max, exponentials and sum over the whole span at once (one rescale of the
// accumulators a span, not a tile); then the weighted V rows, tile by tile again.
template <typename scalar_t, typename index_t, int kD, bool kChunk>
void attend_item(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const index_t* table,
                 int64_t q_len, int64_t num_keys, int64_t kv_head, int64_t group, int64_t head_dim,
                 int64_t block_size, float scale, const Strides& s, scalar_t* out) {
  const int64_t d_len = kD > 0 ? kD : head_dim;
  constexpr bool kVectorD = kD > 0 && kD % kLanes == 0;  // the register-tiled path (tile_scores, span_values)
  constexpr bool kBf16Scores =   // tile_scores_bf16
      switchyard_cpu::kDotBf16 && kVectorD && kD % 32 == 0 && std::is_same_v<scalar_t, c10::BFloat16>;
  const int64_t rows = q_len * group;
  alignas(64) float qf[kBf16Scores ? 1 : kMaxRowElems];     // q widened and scaled, for the float32 scores
  alignas(64) uint16_t qb[kBf16Scores ? kMaxRowElems : 1];  // q's bf16 bits, for tile_scores_bf16
  alignas(64) float acc[kMaxRowElems];
  alignas(64) float scores[kMaxRows * kScoreStride];  // row r's span of scores, then weights, at r * kScoreStride
  alignas(64) float row[kMaxHeadDim];  // one V row widened (head_dim without a vector path)
  SpanTiles tiles;
  float running_max[kMaxRows], running_sum[kMaxRows];
  int64_t key_limit[kMaxRows];  // keys row r attends: its token's position + 1
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = r / group, head = kv_head * group + r % group;
    const scalar_t* q_r = q + token * s.q_token + head * s.q_head;
    for (int64_t d = 0; d < d_len; ++d) {
      if constexpr (kBf16Scores) std::memcpy(&qb[r * d_len + d], &q_r[d], sizeof(uint16_t));
      else qf[r * d_len + d] = to_float(q_r[d]) * scale;
      acc[r * d_len + d] = 0.0f;
    }
    running_max[r] = -std::numeric_limits<float>::infinity();
    running_sum[r] = 0.0f;
    key_limit[r] = num_keys - q_len + token + 1;
  }
  // Where key `key`'s rows for this KV head start in the caches, and the keys from it to its tile's end.
  const auto tile_at = [&](int64_t key, int64_t end) {
    const int64_t first = key % block_size;
    const int64_t offset = static_cast<int64_t>(table[key / block_size]) * s.kv_block + first * s.kv_token +
                           kv_head * s.kv_head;
    return std::pair<int64_t, int64_t>{offset, std::min({kTile, block_size - first, end - key})};
  };
  for (int64_t span_start = 0; span_start < num_keys; span_start += kSpan) {
    const int64_t span_keys = std::min(kSpan, num_keys - span_start);
    tiles.count = 0;
    // A tile stops at its block's end and at the span's; keys past the last are never read (stale rows may hold
    // NaN).
    for (int64_t pos = 0; pos < span_keys;) {
      const auto [offset, tile_keys] = tile_at(span_start + pos, span_start + span_keys);
      tiles.offset[tiles.count] = offset;
      tiles.len[tiles.count++] = tile_keys;
      const int64_t next = span_start + pos + tile_keys;
      if (next < num_keys) {  // the next tile's K rows, from memory while this one computes
        const auto [next_offset, next_keys] = tile_at(next, num_keys);
        prefetch_rows<2>(k_cache + next_offset, s.kv_token, next_keys, d_len);
      }
      prefetch_rows<1>(v_cache + offset, s.kv_token, tile_keys, d_len);
      const scalar_t* k_tile = k_cache + offset;
      float* span_scores = scores + pos;
      if constexpr (kVectorD) {
        if constexpr (kBf16Scores) {
          tile_scores_bf16<kD>(qb, k_tile, s.kv_token, rows, tile_keys, scale, span_scores, kScoreStride);
        } else {
          tile_scores<scalar_t, kD>(qf, k_tile, s.kv_token, rows, tile_keys, span_scores, kScoreStride);
        }
      } else {
        for (int64_t t = 0; t < tile_keys; ++t) {
          const scalar_t* k_row = k_tile + t * s.kv_token;
          for (int64_t r = 0; r < rows; ++r) {
            const float* q_r = qf + r * d_len;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < d_len; ++d) dot += q_r[d] * to_float(k_row[d]);
            span_scores[r * kScoreStride + t] = dot;
          }
        }
      }
      pos += tile_keys;
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* p = scores + r * kScoreStride;
      // Keys of this span the row may see: all of them for a decode, fewer for the earlier tokens of a chunk.
      const int64_t visible = kChunk ? std::clamp<int64_t>(key_limit[r] - span_start, 0, span_keys) : span_keys;
      if (kChunk && visible == 0) {  // the whole span lies after this row's token: no update, and no V weight
        std::fill(p, p + span_keys, 0.0f);
        continue;
      }
      // Whole vectors: the keys past `visible` up to the next multiple of kLanes read as -inf (the buffer has
      // room), then as weight 0.
      const int64_t padded = (visible + kLanes - 1) / kLanes * kLanes;
      std::fill(p + visible, p + padded, -std::numeric_limits<float>::infinity());
      VecF lanes_max = load_vec(p);
      for (int64_t t = kLanes; t < padded; t += kLanes) {
        const VecF v = load_vec(p + t);
        lanes_max = v > lanes_max ? v : lanes_max;
      }
      float span_max = running_max[r];
      for (int i = 0; i < kLanes; ++i) span_max = std::max(span_max, lanes_max[i]);
      const float alpha = std::exp(running_max[r] - span_max);  // 0 on the first span (exp(-inf))
      for (int64_t t = 0; t < padded; ++t) p[t] = exp_nonpositive(p[t] - span_max);
      std::fill(p + visible, p + std::max(padded, kChunk ? span_keys : int64_t{0}), 0.0f);
      VecF lanes_sum = load_vec(p);
      for (int64_t t = kLanes; t < padded; t += kLanes) lanes_sum += load_vec(p + t);
      float span_sum = 0.0f;
      for (int i = 0; i < kLanes; ++i) span_sum += lanes_sum[i];
      running_sum[r] = running_sum[r] * alpha + span_sum;
      running_max[r] = span_max;
      if (alpha != 1.0f) {
        float* acc_r = acc + r * d_len;
        for (int64_t d = 0; d < d_len; ++d) acc_r[d] *= alpha;
      }
    }
    if constexpr (kVectorD) {
      for (int64_t first_row = 0; first_row < rows; first_row += kGroup) {
        switch (std::min(kGroup, rows - first_row)) {
          case 1: span_values<scalar_t, kD, 1>(acc, scores, kScoreStride, v_cache, tiles, s.kv_token, first_row); break;
          case 2: span_values<scalar_t, kD, 2>(acc, scores, kScoreStride, v_cache, tiles, s.kv_token, first_row); break;
          case 3: span_values<scalar_t, kD, 3>(acc, scores, kScoreStride, v_cache, tiles, s.kv_token, first_row); break;
          default: span_values<scalar_t, kD, 4>(acc, scores, kScoreStride, v_cache, tiles, s.kv_token, first_row);
        }
      }
    } else {
      accumulate_v<scalar_t>(acc, scores, kScoreStride, v_cache, tiles, s.kv_token, rows, d_len, row);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.0f / running_sum[r];
    const int64_t token = r / group, head = kv_head * group + r % group;
    scalar_t* o = out + token * s.out_token + head * head_dim;
    for (int64_t d = 0; d < d_len; ++d) o[d] = static_cast<scalar_t>(acc[r * d_len + d] * inv);
  }
}

template <typename scalar_t, typename index_t, int kD>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
         const at::Tensor& seq_lens, const int64_t* query_starts, double scale, at::Tensor& out) {
  const int64_t n = block_tables.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads;
  const Strides s{q.stride(0), q.stride(1), heads * head_dim, k_cache.stride(0), k_cache.stride(1),
                  k_cache.stride(2), block_tables.stride(0)};
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
  const index_t* table_ptr = block_tables.data_ptr<index_t>();
  const index_t* lens_ptr = seq_lens.data_ptr<index_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / kv_heads, kv_head = item % kv_heads;
      const int64_t first = query_starts == nullptr ? seq : query_starts[seq];
      const int64_t q_len = query_starts == nullptr ? 1 : query_starts[seq + 1] - first;
      const int64_t num_keys = static_cast<int64_t>(lens_ptr[seq]);
      const scalar_t* q_first = q_ptr + first * s.q_token;
      const index_t* table = table_ptr + seq * s.table_row;
      scalar_t* out_first = out_ptr + first * s.out_token;
      if (query_starts == nullptr) {
        attend_item<scalar_t, index_t, kD, false>(q_first, k_ptr, v_ptr, table, q_len, num_keys, kv_head, group,
                                                  head_dim, block_size, static_cast<float>(scale), s, out_first);
      } else {
        attend_item<scalar_t, index_t, kD, true>(q_first, k_ptr, v_ptr, table, q_len, num_keys, kv_head, group,
                                                 head_dim, block_size, static_cast<float>(scale), s, out_first);
      }
    }
  });
}

template <typename scalar_t, typename index_t>
void dispatch_head_dim(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_tables, const at::Tensor& seq_lens, const int64_t* query_starts,
                       double scale, at::Tensor& out) {
  switch (q.size(2)) {
    case 64: return run<scalar_t, index_t, 64>(q, k_cache, v_cache, block_tables, seq_lens, query_starts, scale, out);
    case 128: return run<scalar_t, index_t, 128>(q, k_cache, v_cache, block_tables, seq_lens, query_starts, scale, out);
    default: return run<scalar_t, index_t, 0>(q, k_cache, v_cache, block_tables, seq_lens, query_starts, scale, out);
  }
}

template <typename scalar_t>
void dispatch_index(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_tables, const at::Tensor& seq_lens, const int64_t* query_starts,
                    double scale, at::Tensor& out) {
  if (block_tables.scalar_type() == at::kInt) {
    dispatch_head_dim<scalar_t, int32_t>(q, k_cache, v_cache, block_tables, seq_lens, query_starts, scale, out);
  } else {
    dispatch_head_dim<scalar_t, int64_t>(q, k_cache, v_cache, block_tables, seq_lens, query_starts, scale, out);
  }
}

// q [tokens, heads, head_dim] (rows may be strided, head_dim contiguous); k/v caches [blocks, block_size, kv_heads,
// head_dim] contiguous; block_tables [n, >= max blocks] and seq_lens [n] (keys to attend, at least the sequence's
// queries) of one int dtype. query_starts [n + 1] int64: sequence i's queries are q rows query_starts[i] ..
// query_starts[i + 1] - 1, its newest tokens (a few, causal among themselves); absent: one query per sequence, q
// row i (decode).
at::Tensor cpu_paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            const std::optional<at::Tensor>& query_starts, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "cpu_paged_decode runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous(), "bad strides");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(block_tables.dim() == 2 && seq_lens.dim() == 1 && seq_lens.size(0) == block_tables.size(0),
              "block_tables [n, blocks] and seq_lens [n]");
  TORCH_CHECK(block_tables.scalar_type() == seq_lens.scalar_type() && block_tables.stride(1) == 1 &&
                  seq_lens.is_contiguous(), "block_tables and seq_lens: one int dtype, rows contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt || block_tables.scalar_type() == at::kLong, "int indices");
  const int64_t n = block_tables.size(0), heads = q.size(1), kv_heads = k_cache.size(2), head_dim = q.size(2);
  TORCH_CHECK(heads % kv_heads == 0, "unsupported GQA group");
  TORCH_CHECK(head_dim == k_cache.size(3) && head_dim <= kMaxHeadDim, "unsupported head_dim");
  const int64_t group = heads / kv_heads;
  const int64_t* starts = nullptr;
  int64_t max_q_len = 1;
  if (query_starts.has_value()) {
    const at::Tensor& qs = *query_starts;
    TORCH_CHECK(qs.scalar_type() == at::kLong && qs.dim() == 1 && qs.size(0) == n + 1 && qs.is_contiguous(),
                "query_starts: [n + 1] int64");
    starts = qs.data_ptr<int64_t>();
    TORCH_CHECK(starts[0] == 0 && starts[n] == q.size(0), "query_starts must span q's rows from 0");
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(starts[i + 1] > starts[i], "every sequence needs at least one query");
      max_q_len = std::max(max_q_len, starts[i + 1] - starts[i]);
    }
  } else {
    TORCH_CHECK(q.size(0) == n, "without query_starts, one q row per sequence");
  }
  TORCH_CHECK(max_q_len * group <= kMaxRows && max_q_len * group * head_dim <= kMaxRowElems,
              "too many query rows per KV head for the kernel's buffers");
  at::Tensor out = at::empty({q.size(0), heads, head_dim}, q.options());
  if (q.scalar_type() == at::kFloat) {
    dispatch_index<float>(q, k_cache, v_cache, block_tables, seq_lens, starts, scale, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    dispatch_index<c10::BFloat16>(q, k_cache, v_cache, block_tables, seq_lens, starts, scale, out);
  } else {
    TORCH_CHECK(false, "cpu_paged_decode supports float32 and bfloat16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(switchyard_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor? query_starts, float scale) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(cpu_paged_decode));
}
