// The prefill attention kernel's tile products (paged_prefill_attention.cpp): q.K scores and p.V
// accumulation over one tile of kTileK keys, register-blocked for AVX-512 (fp32 FMAs, or AVX512-BF16 dot
// products on bf16 pairs), with portable loops for other CPUs and head sizes; and a row's vector max.
#pragma once

#include <torch/extension.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "bf16.h"

namespace iterserve::prefill {

// Keys per step of the online softmax, gathered from as many cache blocks: each row's max, rescale and
// sum are paid once per tile, which at one 16-token block per step cost as much as the multiply-adds.
constexpr int64_t kTileK = 64;

// s[r][t] = q[r] . k_t for rows [0, R) and the tile's kTileK columns; kt is K^T, [D][kTileK].
template <int64_t kD>
void scores(const float* q, int64_t R, const float* kt, int64_t D, float* s) {
#if defined(__AVX512F__)
  if constexpr (kD > 0) {
    constexpr int64_t NC = kTileK / 16;  // column vectors
    auto rows = [&](int64_t r, auto rows_const) {
      constexpr int64_t RR = decltype(rows_const)::value;
      __m512 c[RR][NC];
      for (int64_t j = 0; j < RR; ++j)
        for (int64_t x = 0; x < NC; ++x) c[j][x] = _mm512_setzero_ps();
      for (int64_t d = 0; d < kD; ++d) {
        __m512 k[NC];
        for (int64_t x = 0; x < NC; ++x) k[x] = _mm512_loadu_ps(kt + d * kTileK + 16 * x);
        for (int64_t j = 0; j < RR; ++j) {
          const __m512 qj = _mm512_set1_ps(q[(r + j) * kD + d]);
          for (int64_t x = 0; x < NC; ++x) c[j][x] = _mm512_fmadd_ps(qj, k[x], c[j][x]);
        }
      }
      for (int64_t j = 0; j < RR; ++j)
        for (int64_t x = 0; x < NC; ++x) _mm512_storeu_ps(s + (r + j) * kTileK + 16 * x, c[j][x]);
    };
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) rows(r, std::integral_constant<int64_t, 4>{});  // 16 accumulators
    for (; r < R; ++r) rows(r, std::integral_constant<int64_t, 1>{});
    return;
  }
#endif
  const int64_t len = kD ? kD : D;
  for (int64_t r = 0; r < R; ++r) {
    float* row = s + r * kTileK;
    for (int64_t t = 0; t < kTileK; ++t) row[t] = 0.f;
    for (int64_t d = 0; d < len; ++d) {
      const float a = q[r * len + d];
      const float* k = kt + d * kTileK;
#pragma omp simd
      for (int64_t t = 0; t < kTileK; ++t) row[t] += a * k[t];
    }
  }
}

// Whether q.K runs on AVX512-BF16's dot products (vdpbf16ps): bf16 inputs, head_dim a multiple of 32.
// Each instruction multiplies 16 pairs of bf16 exactly and adds them in fp32, twice the multiply-adds of
// an fp32 FMA; q and K enter as the cache holds them, so q.K loses nothing. The softmax stays fp32; p
// is rounded to bf16 for p.V, as torch's bf16 SDPA and vLLM's CPU attention do.
template <typename T, int64_t kD>
constexpr bool kPairDot =
#if defined(__AVX512BF16__)
    std::is_same_v<T, iterserve::bf16> && kD > 0 && kD % 32 == 0;
#else
    false;
#endif

#if defined(__AVX512BF16__)
// s[r][t] = scale * q[r] . k_t with qp [R][kD/2] and ktp [kD/2][kTileK] bf16 pairs (one uint32 each).
template <int64_t kD>
void scores_pairs(const uint32_t* qp, int64_t R, const uint32_t* ktp, float scale, float* s) {
  constexpr int64_t NC = kTileK / 16, P = kD / 2;
  const __m512 vscale = _mm512_set1_ps(scale);
  auto rows = [&](int64_t r, auto rows_const) {
    constexpr int64_t RR = decltype(rows_const)::value;
    __m512 c[RR][NC];
    for (int64_t j = 0; j < RR; ++j)
      for (int64_t x = 0; x < NC; ++x) c[j][x] = _mm512_setzero_ps();
    for (int64_t i = 0; i < P; ++i) {
      __m512bh k[NC];
      for (int64_t x = 0; x < NC; ++x) k[x] = (__m512bh)_mm512_loadu_si512(ktp + i * kTileK + 16 * x);
      for (int64_t j = 0; j < RR; ++j) {
        const __m512bh qj = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[(r + j) * P + i]));
        for (int64_t x = 0; x < NC; ++x) c[j][x] = _mm512_dpbf16_ps(c[j][x], qj, k[x]);
      }
    }
    for (int64_t j = 0; j < RR; ++j)
      for (int64_t x = 0; x < NC; ++x) _mm512_storeu_ps(s + (r + j) * kTileK + 16 * x, _mm512_mul_ps(c[j][x], vscale));
  };
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) rows(r, std::integral_constant<int64_t, 4>{});
  for (; r < R; ++r) rows(r, std::integral_constant<int64_t, 1>{});
}

// acc[r] += sum_t p[r][t] v_t with pp [R][kTileK/2] and vp [kTileK/2][kD] bf16 pairs along the keys.
template <int64_t kD>
void apply_pairs(float* acc, int64_t R, const uint32_t* vp, int64_t num_pairs, const uint32_t* pp) {
  constexpr int64_t C = kD / 16, kRows = std::max<int64_t>(1, 16 / C);
  auto rows = [&](int64_t r, auto rows_const) {
    constexpr int64_t RR = decltype(rows_const)::value;
    __m512 a[RR][C];
    for (int64_t j = 0; j < RR; ++j)
      for (int64_t c = 0; c < C; ++c) a[j][c] = _mm512_loadu_ps(acc + (r + j) * kD + 16 * c);
    for (int64_t i = 0; i < num_pairs; ++i) {
      __m512bh vv[C];
      for (int64_t c = 0; c < C; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vp + i * kD + 16 * c);
      for (int64_t j = 0; j < RR; ++j) {
        const __m512bh pj = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[(r + j) * (kTileK / 2) + i]));
        for (int64_t c = 0; c < C; ++c) a[j][c] = _mm512_dpbf16_ps(a[j][c], pj, vv[c]);
      }
    }
    for (int64_t j = 0; j < RR; ++j)
      for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(acc + (r + j) * kD + 16 * c, a[j][c]);
  };
  int64_t r = 0;
  for (; r + kRows <= R; r += kRows) rows(r, std::integral_constant<int64_t, kRows>{});
  for (; r < R; ++r) rows(r, std::integral_constant<int64_t, 1>{});
}
#endif

// acc[r] += sum_t p[r][t] v_t for rows [0, R) and the tile's first n keys; v is [kTileK][D] fp32.
template <int64_t kD>
void apply(float* acc, int64_t R, const float* v, int64_t n, int64_t D, const float* p) {
#if defined(__AVX512F__)
  if constexpr (kD > 0 && kD % 16 == 0 && kD <= 256) {
    constexpr int64_t C = kD / 16, kRows = std::max<int64_t>(1, 16 / C);  // 16 accumulators
    int64_t r = 0;
    auto rows = [&](auto rows_const) {
      constexpr int64_t RR = decltype(rows_const)::value;
      __m512 a[RR][C];
      for (int64_t j = 0; j < RR; ++j)
        for (int64_t c = 0; c < C; ++c) a[j][c] = _mm512_loadu_ps(acc + (r + j) * kD + 16 * c);
      for (int64_t t = 0; t < n; ++t) {
        __m512 vv[C];
        for (int64_t c = 0; c < C; ++c) vv[c] = _mm512_loadu_ps(v + t * kD + 16 * c);
        for (int64_t j = 0; j < RR; ++j) {
          const __m512 pj = _mm512_set1_ps(p[(r + j) * kTileK + t]);
          for (int64_t c = 0; c < C; ++c) a[j][c] = _mm512_fmadd_ps(pj, vv[c], a[j][c]);
        }
      }
      for (int64_t j = 0; j < RR; ++j)
        for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(acc + (r + j) * kD + 16 * c, a[j][c]);
    };
    for (; r + kRows <= R; r += kRows) rows(std::integral_constant<int64_t, kRows>{});
    for (; r < R; ++r) rows(std::integral_constant<int64_t, 1>{});
    return;
  }
#endif
  const int64_t len = kD ? kD : D;
  for (int64_t r = 0; r < R; ++r) {
    float* a = acc + r * len;
    for (int64_t t = 0; t < n; ++t) {
      const float pt = p[r * kTileK + t];
      const float* vt = v + t * len;
#pragma omp simd
      for (int64_t d = 0; d < len; ++d) a[d] += pt * vt[d];
    }
  }
}

// max(p[0], ..., p[valid - 1]), valid in [1, kTileK]. GCC leaves an `omp simd` max reduction over floats
// scalar (it keeps NaN order), and it took a fifth of the kernel's time.
inline float row_max(const float* p, int64_t valid) {
#if defined(__AVX512F__)
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < valid; t += 16) {  // p holds kTileK floats: a whole vector is always in bounds
    const __mmask16 k = valid - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (valid - t)) - 1);
    m = _mm512_mask_max_ps(m, k, m, _mm512_loadu_ps(p + t));
  }
  return _mm512_reduce_max_ps(m);
#else
  float m = p[0];
  for (int64_t t = 1; t < valid; ++t) m = std::max(m, p[t]);
  return m;
#endif
}

}  // namespace iterserve::prefill
