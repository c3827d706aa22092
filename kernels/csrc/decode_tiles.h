// The decode attention kernel's block products (paged_decode_attention.cpp): one cache block's K rows
// against a KV head's query rows (scores), and its V rows into their accumulators (apply), for AVX-512
// (fp32 FMAs on rows widened from the cache's dtype, or AVX512-BF16 dot products on a bf16 cache) with
// portable loops for other CPUs and head sizes; and the small vector helpers the kernel's softmax uses.
#pragma once

#include <torch/extension.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "bf16.h"

namespace iterserve::decode {

using iterserve::bf16;
using iterserve::load;

// The head_dim loops are `omp simd` so GCC vectorizes them; -march=native picks the vector width. `D` is
// a compile-time constant for the common head sizes (see attend's dispatch), so they unroll fully; 0
// means a head size known only at run time (`n`).
//
// dot's sum across vector lanes is written out with intrinsics where the CPU has them: for an `omp simd`
// reduction GCC adds the lanes one at a time, and those scalar adds took most of the kernel's time.
// T: the cache's element type; the query side is always fp32 scratch.
template <int64_t D, typename T>
inline float dot(const float* __restrict a, const T* __restrict b, int64_t n) {
#if defined(__AVX512F__)
  if constexpr (D > 0 && D % 16 == 0) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), iterserve::load16(b));
    for (int64_t i = 16; i < D; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), iterserve::load16(b + i), acc);
    return _mm512_reduce_add_ps(acc);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (D > 0 && D % 8 == 0) {
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), iterserve::load8(b));
    for (int64_t i = 8; i < D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), iterserve::load8(b + i), acc);
    const __m128 quad = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    const __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
    return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
  }
#endif
  const int64_t len = D ? D : n;
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < len; ++i) s += a[i] * load(b[i]);
  return s;
}

template <int64_t D, typename T>
inline void axpy(float* __restrict y, float a, const T* __restrict x, int64_t n) {
  const int64_t len = D ? D : n;
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) y[i] += a * load(x[i]);
}

// y = a * x, stored as Y (the output's type) from X (the query's, or fp32 scratch).
template <typename Y, typename X>
inline void scale_into(Y* __restrict y, float a, const X* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) iterserve::store(&y[i], a * load(x[i]));
}

// max(p[0], ..., p[n - 1]), n >= 1. GCC leaves an `omp simd` max reduction over floats scalar (it keeps
// NaN order).
inline float max_of(const float* p, int64_t n) {
#if defined(__AVX512F__)
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 k = n - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - t)) - 1);
    m = _mm512_mask_max_ps(m, k, m, _mm512_maskz_loadu_ps(k, p + t));
  }
  return _mm512_reduce_max_ps(m);
#else
  float m = p[0];
  for (int64_t t = 1; t < n; ++t) m = std::max(m, p[t]);
  return m;
#endif
}

// One cache block against one KV head's G query rows: scores[g * bs + t] = q_g . k_t (block_scores), and
// acc_g += sum_t scores[g * bs + t] v_t (block_apply), for the block's n tokens; K and V rows are
// `stride` elements apart. The AVX-512 forms go token by token and load (and widen, from bf16) each K or V
// row once for up to kRows query rows of the group, whose query rows or accumulators stay in registers
// for the whole block: with GQA's groups, loading a row once per query row spent more time widening bf16
// than multiplying. The portable forms serve other CPUs and head sizes.
#if defined(__AVX512F__)
// f(r, integral_constant<RR>) for the rows [r, r + RR) of G: chunks of kMax (at most 4), then one of the rest.
template <int64_t kMax, typename F>
inline void for_row_chunks(int64_t G, F&& f) {
  static_assert(kMax >= 1 && kMax <= 4);
  int64_t r = 0;
  for (; r + kMax <= G; r += kMax) f(r, std::integral_constant<int64_t, kMax>{});
  const int64_t rest = G - r;
  if constexpr (kMax > 3) {
    if (rest == 3) return f(r, std::integral_constant<int64_t, 3>{});
  }
  if constexpr (kMax > 2) {
    if (rest == 2) return f(r, std::integral_constant<int64_t, 2>{});
  }
  if (rest == 1) f(r, std::integral_constant<int64_t, 1>{});
}

// RR query rows (registers: RR * kD / 16, plus the K row and the folds) against n K rows.
template <int64_t kD, int64_t RR, typename T>
inline void scores_rows(const float* q, const T* k, int64_t n, int64_t stride, float* scores, int64_t bs) {
  constexpr int64_t C = kD / 16;
  __m512 qv[RR][C];
  for (int64_t j = 0; j < RR; ++j)
    for (int64_t c = 0; c < C; ++c) qv[j][c] = _mm512_loadu_ps(q + j * kD + 16 * c);
  // row j's 16 partial sums of one token folded to 4
  auto fold = [&](const __m512* kv, int64_t j) {
    __m512 p = _mm512_mul_ps(qv[j][0], kv[0]);
    for (int64_t c = 1; c < C; ++c) p = _mm512_fmadd_ps(qv[j][c], kv[c], p);
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(p), _mm512_extractf32x8_ps(p, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  };
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {  // four tokens' folds summed into one vector per row
    __m128 f[RR][4];
    for (int64_t u = 0; u < 4; ++u) {
      __m512 kv[C];
      for (int64_t c = 0; c < C; ++c) kv[c] = iterserve::load16(k + (t + u) * stride + 16 * c);
      for (int64_t j = 0; j < RR; ++j) f[j][u] = fold(kv, j);
    }
    for (int64_t j = 0; j < RR; ++j) {
      const __m128 a = _mm_hadd_ps(f[j][0], f[j][1]), b = _mm_hadd_ps(f[j][2], f[j][3]);
      _mm_storeu_ps(scores + j * bs + t, _mm_hadd_ps(a, b));
    }
  }
  for (; t < n; ++t) {
    __m512 kv[C];
    for (int64_t c = 0; c < C; ++c) kv[c] = iterserve::load16(k + t * stride + 16 * c);
    for (int64_t j = 0; j < RR; ++j) {
      __m128 x = fold(kv, j);
      x = _mm_hadd_ps(x, x);
      scores[j * bs + t] = _mm_cvtss_f32(_mm_hadd_ps(x, x));
    }
  }
}

#if defined(__AVX512BF16__)
// scores_rows for a bf16 cache on AVX512-BF16's dot products: q (as given, bf16) and each K row enter as
// bf16 pairs, two vdpbf16ps a row at head_dim 64 instead of four widenings and four FMAs; the products
// are exact and summed in fp32, then scaled.
template <int64_t kD, int64_t RR>
inline void scores_rows_pairs(const iterserve::bf16* q, const iterserve::bf16* k, int64_t n, int64_t stride,
                              float scale, float* scores, int64_t bs) {
  constexpr int64_t C = kD / 32;
  const __m128 vscale = _mm_set1_ps(scale);
  __m512bh qv[RR][C];
  for (int64_t j = 0; j < RR; ++j)
    for (int64_t c = 0; c < C; ++c) qv[j][c] = (__m512bh)_mm512_loadu_si512(q + j * kD + 32 * c);
  auto fold = [&](const __m512bh* kv, int64_t j) {
    __m512 p = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[j][0], kv[0]);
    for (int64_t c = 1; c < C; ++c) p = _mm512_dpbf16_ps(p, qv[j][c], kv[c]);
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(p), _mm512_extractf32x8_ps(p, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  };
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    __m128 f[RR][4];
    for (int64_t u = 0; u < 4; ++u) {
      __m512bh kv[C];
      for (int64_t c = 0; c < C; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(k + (t + u) * stride + 32 * c);
      for (int64_t j = 0; j < RR; ++j) f[j][u] = fold(kv, j);
    }
    for (int64_t j = 0; j < RR; ++j) {
      const __m128 a = _mm_hadd_ps(f[j][0], f[j][1]), b = _mm_hadd_ps(f[j][2], f[j][3]);
      _mm_storeu_ps(scores + j * bs + t, _mm_mul_ps(_mm_hadd_ps(a, b), vscale));
    }
  }
  for (; t < n; ++t) {
    __m512bh kv[C];
    for (int64_t c = 0; c < C; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(k + t * stride + 32 * c);
    for (int64_t j = 0; j < RR; ++j) {
      __m128 x = fold(kv, j);
      x = _mm_hadd_ps(x, x);
      scores[j * bs + t] = _mm_cvtss_f32(_mm_hadd_ps(x, x)) * scale;
    }
  }
}
#endif

// Whether block scores run on bf16 dot products (scores_rows_pairs): a bf16 cache, head_dim 32 or 64.
template <typename T, int64_t kD>
constexpr bool kPairScores =
#if defined(__AVX512BF16__)
    std::is_same_v<T, iterserve::bf16> && kD > 0 && kD % 32 == 0 && kD <= 64;
#else
    false;
#endif

// acc_j += sum_t scores[j * bs + t] v_t for RR rows (registers: RR * kD / 16 accumulators and the V row).
template <int64_t kD, int64_t RR, typename T>
inline void apply_rows(float* acc, const T* v, int64_t n, int64_t stride, const float* scores, int64_t bs) {
  constexpr int64_t C = kD / 16;
  __m512 a[RR][C];
  for (int64_t j = 0; j < RR; ++j)
    for (int64_t c = 0; c < C; ++c) a[j][c] = _mm512_loadu_ps(acc + j * kD + 16 * c);
  for (int64_t t = 0; t < n; ++t) {
    __m512 vv[C];
    for (int64_t c = 0; c < C; ++c) vv[c] = iterserve::load16(v + t * stride + 16 * c);
    for (int64_t j = 0; j < RR; ++j) {
      const __m512 p = _mm512_set1_ps(scores[j * bs + t]);
      for (int64_t c = 0; c < C; ++c) a[j][c] = _mm512_fmadd_ps(p, vv[c], a[j][c]);
    }
  }
  for (int64_t j = 0; j < RR; ++j)
    for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(acc + j * kD + 16 * c, a[j][c]);
}
#endif

#if defined(__AVX512BF16__)
// Whether block_apply runs on bf16 dot products (apply_rows_pairs): a bf16 cache, head_dim 32, 64 or 128,
// and a block of at most kMaxPairBlock tokens (the kernel checks the block size at run time).
constexpr int64_t kMaxPairBlock = 64;
template <typename T, int64_t kD>
constexpr bool kPairApply = std::is_same_v<T, iterserve::bf16> && kD > 0 && kD % 32 == 0 && kD <= 128;

// apply_rows for a bf16 cache on AVX512-BF16's dot products. Two tokens' V rows are interleaved into bf16
// pairs (vpunpcklwd / vpunpckhwd) and multiplied with each query row's two probabilities, rounded to bf16
// as the prefill kernel and torch's bf16 SDPA round p: per 32 elements of two tokens, two unpacks shared
// by the group and two vdpbf16ps a query row, where apply_rows widens four half-rows and runs four FMAs.
// The unpacks work within 128-bit lanes, so the accumulators come out in lane order: acc holds each
// 32-element chunk as [the unpacklo lanes, the unpackhi lanes] while the kernel runs (the softmax's
// rescales are elementwise and do not mind), and unpermute_pairs puts it back in order at the end.
template <int64_t kD, int64_t RR>
inline void apply_rows_pairs(float* acc, const iterserve::bf16* v, int64_t n, int64_t stride, const float* scores,
                             int64_t bs) {
  constexpr int64_t C = kD / 32;
  // p in bf16 pairs: pp[j][i] = (bf16(p_2i), bf16(p_2i+1)), zero past the block's n tokens
  alignas(64) uint32_t pp[RR][kMaxPairBlock / 2];
  for (int64_t j = 0; j < RR; ++j) {
    for (int64_t t = 0; t < n; t += 32) {
      const auto mask = [&](int64_t from) {
        const int64_t k = std::clamp<int64_t>(n - from, 0, 16);
        return static_cast<__mmask16>(k == 16 ? 0xFFFFu : (1u << k) - 1);
      };
      const __m512 a = _mm512_maskz_loadu_ps(mask(t), scores + j * bs + t);
      const __m512 b = _mm512_maskz_loadu_ps(mask(t + 16), scores + j * bs + t + 16);
      _mm512_storeu_si512(&pp[j][t / 2], (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
  }
  __m512 lo[RR][C], hi[RR][C];
  for (int64_t j = 0; j < RR; ++j)
    for (int64_t c = 0; c < C; ++c) {
      lo[j][c] = _mm512_loadu_ps(acc + j * kD + 32 * c);
      hi[j][c] = _mm512_loadu_ps(acc + j * kD + 32 * c + 16);
    }
  for (int64_t t = 0; t < n; t += 2) {
    __m512bh vlo[C], vhi[C];
    for (int64_t c = 0; c < C; ++c) {
      const __m512i v0 = _mm512_loadu_si512(v + t * stride + 32 * c);
      // an odd block's last token pairs with zeros: the row past it is not the block's
      const __m512i v1 = t + 1 < n ? _mm512_loadu_si512(v + (t + 1) * stride + 32 * c) : _mm512_setzero_si512();
      vlo[c] = (__m512bh)_mm512_unpacklo_epi16(v0, v1);
      vhi[c] = (__m512bh)_mm512_unpackhi_epi16(v0, v1);
    }
    for (int64_t j = 0; j < RR; ++j) {
      const __m512bh pj = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[j][t / 2]));
      for (int64_t c = 0; c < C; ++c) {
        lo[j][c] = _mm512_dpbf16_ps(lo[j][c], pj, vlo[c]);
        hi[j][c] = _mm512_dpbf16_ps(hi[j][c], pj, vhi[c]);
      }
    }
  }
  for (int64_t j = 0; j < RR; ++j)
    for (int64_t c = 0; c < C; ++c) {
      _mm512_storeu_ps(acc + j * kD + 32 * c, lo[j][c]);
      _mm512_storeu_ps(acc + j * kD + 32 * c + 16, hi[j][c]);
    }
}

// One accumulator row from apply_rows_pairs' lane order back to element order. In a chunk, unpacklo's
// fp32 lane i holds element 8 * (i / 4) + i % 4 and unpackhi's lane i element 8 * (i / 4) + 4 + i % 4.
template <int64_t kD>
inline void unpermute_pairs(float* acc) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t c = 0; c < kD / 32; ++c) {
    const __m512 lo = _mm512_loadu_ps(acc + 32 * c), hi = _mm512_loadu_ps(acc + 32 * c + 16);
    _mm512_storeu_ps(acc + 32 * c, _mm512_permutex2var_ps(lo, first, hi));
    _mm512_storeu_ps(acc + 32 * c + 16, _mm512_permutex2var_ps(lo, second, hi));
  }
}
#else
template <typename T, int64_t kD>
constexpr bool kPairApply = false;
constexpr int64_t kMaxPairBlock = 0;
#endif

template <int64_t kD, typename T>
inline void block_scores(const float* q, int64_t G, const T* k, int64_t n, int64_t stride, int64_t D,
                         float* scores, int64_t bs) {
#if defined(__AVX512F__)
  if constexpr (kD > 0 && kD % 16 == 0 && kD <= 128) {
    // 3 rows at head_dim 64 (SmolLM2's and Llama 3's groups of 3 and 4 in one or two chunks), 1 at 128
    constexpr int64_t kRows = kD <= 64 ? 3 : 1;
    for_row_chunks<kRows>(G, [&](int64_t r, auto rows) {
      scores_rows<kD, decltype(rows)::value>(q + r * kD, k, n, stride, scores + r * bs, bs);
    });
    return;
  }
#endif
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t g = 0; g < G; ++g) scores[g * bs + t] = dot<kD>(q + g * D, k + t * stride, D);
  }
}

template <int64_t kD, typename T>
inline void block_apply(float* acc, int64_t G, const T* v, int64_t n, int64_t stride, int64_t D,
                        const float* scores, int64_t bs) {
#if defined(__AVX512F__)
#if defined(__AVX512BF16__)
  if constexpr (kPairApply<T, kD>) {
    if (bs <= kMaxPairBlock) {  // acc in apply_rows_pairs' lane order: the kernel unpermutes it at the end
      constexpr int64_t kRows = kD <= 64 ? 4 : 2;  // at most 16 accumulators
      for_row_chunks<kRows>(G, [&](int64_t r, auto rows) {
        apply_rows_pairs<kD, decltype(rows)::value>(acc + r * kD, v, n, stride, scores + r * bs, bs);
      });
      return;
    }
  }
#endif
  if constexpr (kD > 0 && kD % 16 == 0 && kD <= 128) {
    constexpr int64_t kRows = kD <= 64 ? 4 : 2;  // at most 16 accumulators
    for_row_chunks<kRows>(G, [&](int64_t r, auto rows) {
      apply_rows<kD, decltype(rows)::value>(acc + r * kD, v, n, stride, scores + r * bs, bs);
    });
    return;
  }
#endif
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t g = 0; g < G; ++g) axpy<kD>(acc + g * D, scores[g * bs + t], v + t * stride, D);
  }
}

}  // namespace iterserve::decode
