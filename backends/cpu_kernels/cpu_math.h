// Scalar helpers the CPU kernels share, written so that loops over them vectorize under -O3 with the ISA flags
// of backends/cpu_kernels/__init__.py (no libm calls, no c10::BFloat16 conversions in inner loops).
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace switchyard_cpu {

// Whether the build has AVX512-BF16's vdpbf16ps (cpu_kernels.compile_flags adds -mavx512bf16 where the CPU has
// it): bf16 pairs multiplied as they lie, products exact in float32, sums in float32.
#ifdef __AVX512BF16__
constexpr bool kDotBf16 = true;
#else
constexpr bool kDotBf16 = false;
#endif

// exp(x) for x <= 0 in a form the compiler vectorizes (no libm call): 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2,
// p Cephes' expf polynomial (about 1 ulp). Below -87 the result is clamped to ~1e-38, as good as 0 here.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // a vector max/blend only under -fno-trapping-math (cpu_kernels.compile_flags)
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));  // a bit cast (C++17: no std::bit_cast)
  return p * two_n;
}

// Element access by raw bits: Elem<T>::load widens to float, store rounds to nearest even (NaN stays NaN),
// round does both (where an op-by-op reference stores an intermediate in T). Identity for float.
template <typename scalar_t>
struct Elem {
  using raw = float;
  static float load(float v) { return v; }
  static float store(float v) { return v; }
  static float round(float v) { return v; }
};

template <>
struct Elem<c10::BFloat16> {
  using raw = uint16_t;
  static float load(uint16_t bits) {
    const uint32_t wide = static_cast<uint32_t>(bits) << 16;
    float v;
    std::memcpy(&v, &wide, sizeof(v));
    return v;
  }
  static uint16_t store(float v) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return static_cast<uint16_t>(bits >> 16);
  }
  static float round(float v) { return load(store(v)); }
};

// A vector of kLanes floats in the compiler's generic vector type (one register: 16 lanes, a zmm, where the build
// targets AVX-512, 8, a ymm, elsewhere; on narrower vectors the compiler splits it). Loops over such vectors keep
// accumulators in registers where plain loops over arrays reload and store them (gcc cannot prove them apart).
// Same-size vector casts are bit casts.
#ifdef __AVX512F__
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float VecF __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint16_t VecH __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t VecU __attribute__((vector_size(kLanes * sizeof(uint32_t))));

inline VecF load_vec(const float* p) {
  VecF v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// bf16 bits widened to the float32 with those as its high half. The zero extension is one instruction (vpmovzxwd
// from memory) where named here; gcc 12 turns __builtin_convertvector into two half-width ones and an insert.
inline VecF load_vec(const uint16_t* p) {
#if defined(__AVX512F__)
  const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  return reinterpret_cast<const VecF&>(wide);
#elif defined(__AVX2__)
  const __m256i wide = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  return reinterpret_cast<const VecF&>(wide);
#else
  VecH h;
  std::memcpy(&h, p, sizeof(h));
  const VecU wide = __builtin_convertvector(h, VecU) << 16;
  return reinterpret_cast<const VecF&>(wide);
#endif
}

inline VecF load_vec(const c10::BFloat16* p) { return load_vec(reinterpret_cast<const uint16_t*>(p)); }

}  // namespace switchyard_cpu
