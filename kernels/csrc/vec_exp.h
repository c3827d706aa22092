// exp(x) in a form GCC vectorizes inside `omp simd` loops (std::exp stays a scalar libm call): Cephes'
// expf range reduction and polynomial, about 2 ulp, against torch's Sleef exp at 1 ulp. Shared by the
// CPU kernels of this folder.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace iterserve {

// The polynomial's multiply-adds, fused where the CPU has FMA: fewer instructions per lane. Explicit,
// so a file built with -ffp-contract=off still keeps every other expression as torch rounds it.
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
inline float madd(float a, float b, float c) { return std::fma(a, b, c); }
#else
inline float madd(float a, float b, float c) { return a * b + c; }
#endif

// exp's input range. Callers read it through volatiles (kExpLo/kExpHi below) into locals: with
// constant bounds GCC compiles the clamped lanes as cases of their own, and silu's loop ran 1.2x
// slower. The clamp keeps 2^n a normal float.
inline volatile float kExpLo = -87.3f, kExpHi = 88.3f;

inline float exp_approx(float x, float lo, float hi) {
  x = std::min(std::max(x, lo), hi);
  // n = round(x / ln 2) by the 1.5 * 2^23 trick: floor/nearbyint do not vectorize everywhere
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const float r = madd(n, 2.12194440e-4f, madd(n, -0.693359375f, x));  // x - n ln 2, in two parts
  float p = 1.9875691500e-4f;
  p = madd(p, r, 1.3981999507e-3f);
  p = madd(p, r, 8.3334519073e-3f);
  p = madd(p, r, 4.1665795894e-2f);
  p = madd(p, r, 1.6666665459e-1f);
  p = madd(p, r, 5.0000001201e-1f);
  p = madd(p, r * r, r + 1.f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace iterserve
