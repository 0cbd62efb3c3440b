// Scalar helpers the CPU kernels share, written so that loops over them vectorize under -O3 with the ISA flags
// of backends/cpu_kernels/__init__.py (no libm calls, no c10::BFloat16 conversions in inner loops).
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace switchyard_cpu {

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

}  // namespace switchyard_cpu
