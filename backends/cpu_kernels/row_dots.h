// Dot products of a few weight rows with a few token rows, the inner kernel of the CPU's small products
// (moe_experts.cpp, rows_linear.cpp): out[m, r] = w[r, :] . x[m, :] for weights [rows, K] in float32 or bf16 bits
// and float32 token rows (or bf16 ones, with bf16 weights, where kDotBf16), register-blocked (kRows weight rows
// by up to kMaxTokens tokens of float32 vector accumulators), the weights streamed once per block of tokens.
// Written for decode steps: 1-32 token rows, where a library GEMM spends its time starting up and reads the
// weights at half the memory's speed.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_math.h"

namespace switchyard_cpu {

#if defined(__AVX512F__)
constexpr int kMaxTokens = 6;   // 4 x 6 accumulators + 6 token vectors + 1 weight vector of 32 registers
#else
constexpr int kMaxTokens = 3;   // 4 x 3 + 3 + 1 = 16 registers
#endif
constexpr int kRows = 4;        // weight rows per register block
constexpr int64_t kTileRows = 16;   // weight rows per parallel task (gate_up: this many gate and as many up rows)

inline float widen(float v) { return v; }
inline float widen(uint16_t bits) { return Elem<c10::BFloat16>::load(bits); }

inline float lane_sum(VecF v) {
  float sum = 0.0f;
  for (int i = 0; i < kLanes; ++i) sum += v[i];
  return sum;
}

// out[m * out_stride + r] = w[r, :] . xs[m][:] for R weight rows (w, row length K) and M token rows.
template <int R, int M, typename W>
inline void dot_block(const W* w, int64_t K, const float* const* xs, float* out, int64_t out_stride) {
  VecF acc[M][R] = {};
  // bf16: the next R rows (contiguous after these) are fetched into cache while these are read, a line or more
  // per step. A row of 2048 is one page, and the hardware's prefetchers stop at page boundaries: on the AVX2 EPYC
  // this took one expert read from 16 to 21 GB/s; for float32 rows (two pages) it made the reads slower.
  const char* ahead = reinterpret_cast<const char*>(w + R * K);
  constexpr int64_t kStepBytes = R * kLanes * sizeof(W);
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    if constexpr (sizeof(W) == 2) {
      for (int64_t b = 0; b < kStepBytes; b += 64) __builtin_prefetch(ahead + k * R * sizeof(W) + b);
    }
    VecF xv[M];
    for (int m = 0; m < M; ++m) xv[m] = load_vec(xs[m] + k);
    for (int r = 0; r < R; ++r) {
      const VecF wv = load_vec(w + r * K + k);
      for (int m = 0; m < M; ++m) acc[m][r] += wv * xv[m];
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int r = 0; r < R; ++r) {
      float sum = lane_sum(acc[m][r]);
      for (int64_t j = k; j < K; ++j) sum += widen(w[r * K + j]) * xs[m][j];
      out[m * out_stride + r] = sum;
    }
  }
}

#ifdef __AVX512BF16__
// Where the CPU has AVX512-BF16 and the token rows are bf16 too (bf16 bits, as the weights): vdpbf16ps multiplies
// 32 pairs an instruction as they lie (products exact in float32, sums in float32), so the weights are not widened
// and a block takes half the multiply instructions. The same prefetch of the next R rows as above.
template <int R, int M>
inline void dot_block(const uint16_t* w, int64_t K, const uint16_t* const* xs, float* out, int64_t out_stride) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m) {
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  }
  const char* ahead = reinterpret_cast<const char*>(w + R * K);
  constexpr int64_t kStep = 32, kStepBytes = R * kStep * sizeof(uint16_t);
  int64_t k = 0;
  for (; k + kStep <= K; k += kStep) {
    for (int64_t b = 0; b < kStepBytes; b += 64) __builtin_prefetch(ahead + k * R * sizeof(uint16_t) + b);
    __m512bh xv[M];
    for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(xs[m] + k);
    for (int r = 0; r < R; ++r) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + r * K + k);
      for (int m = 0; m < M; ++m) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv, xv[m]);
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int r = 0; r < R; ++r) {
      float sum = _mm512_reduce_add_ps(acc[m][r]);
      for (int64_t j = k; j < K; ++j) sum += widen(w[r * K + j]) * widen(xs[m][j]);
      out[m * out_stride + r] = sum;
    }
  }
}
#endif

// X: the token rows' type, float32 (any weights) or bf16 bits (bf16 weights, where kDotBf16).
template <int R, typename W, typename X>
inline void dot_tokens(const W* w, int64_t K, const X* const* xs, int64_t M, float* out, int64_t out_stride) {
  int64_t m = 0;
  for (; m + kMaxTokens <= M; m += kMaxTokens) {
    dot_block<R, kMaxTokens>(w, K, xs + m, out + m * out_stride, out_stride);
  }
  switch (M - m) {   // the last 1 .. kMaxTokens - 1 tokens
#define SWITCHYARD_TAIL(n) \
  case n:                  \
    if constexpr (n < kMaxTokens) dot_block<R, n>(w, K, xs + m, out + m * out_stride, out_stride); \
    break;
    SWITCHYARD_TAIL(1)
    SWITCHYARD_TAIL(2)
    SWITCHYARD_TAIL(3)
    SWITCHYARD_TAIL(4)
    SWITCHYARD_TAIL(5)
#undef SWITCHYARD_TAIL
    default:
      break;
  }
}

// out[m * out_stride + r] = w[r, :] . xs[m][:] for `rows` weight rows and M token rows.
template <typename W, typename X>
void rows_times_tokens(const W* w, int64_t rows, int64_t K, const X* const* xs, int64_t M, float* out,
                       int64_t out_stride) {
  if constexpr (sizeof(W) == 2 && sizeof(X) == 4) {
    if (M > 2 * kMaxTokens) {   // over two blocks of tokens: widen each group of bf16 rows once, not per block
      thread_local std::vector<float> wide;
      wide.resize(kRows * K);
      for (int64_t r = 0; r < rows; r += kRows) {
        const int64_t n = std::min<int64_t>(kRows, rows - r);
        for (int64_t i = 0; i < n * K; ++i) wide[i] = widen(w[r * K + i]);
        rows_times_tokens(wide.data(), n, K, xs, M, out + r, out_stride);
      }
      return;
    }
  }
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) dot_tokens<kRows>(w + r * K, K, xs, M, out + r, out_stride);
  for (; r < rows; ++r) dot_tokens<1>(w + r * K, K, xs, M, out + r, out_stride);
}

}  // namespace switchyard_cpu
