// The element types the CPU kernels of this folder store: float32 and bfloat16. Kernels are templated
// on the storage type, compute in fp32 and convert only on load and store, so for float both are the
// identity and the fp32 kernels compile to what they were before.
//
// The conversions are integer bit operations, which GCC vectorizes inside `omp simd` loops on any x86-64
// level, rather than AVX512-BF16's vcvtneps2bf16: that instruction flushes denormals to zero, so a
// -march=native build on a CPU with it and a prebuilt x86-64-v4 build (no avx512_bf16) would round
// differently. These round as torch's `.to(torch.bfloat16)` does, bit for bit (NaN excepted, which
// stays a NaN), so a bf16 add here equals torch's bf16 add.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace iterserve {

// bfloat16 storage: the high half of a float32. A type of its own so that load/store overload on it.
struct bf16 {
  uint16_t bits;
};

inline float load(float x) { return x; }
inline float load(bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// x in T. For bf16: round to nearest even; a NaN becomes the canonical quiet NaN (rounding could carry
// it into infinity).
template <typename T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline bf16 from_float<bf16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return bf16{static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded)};
}

template <typename T>
inline void store(T* p, float x) { *p = from_float<T>(x); }

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif
#if defined(__AVX2__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

// t's data as T (T = float or bf16, which must match its dtype: see dispatch).
template <typename T>
inline T* data(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

// f(float{}) or f(bf16{}) as `dtype` is float32 or bfloat16; any other dtype raises, naming `what`.
template <typename F>
inline auto dispatch(at::ScalarType dtype, const char* what, F&& f) {
  if (dtype == at::kBFloat16) return f(bf16{});
  TORCH_CHECK(dtype == at::kFloat, what, ": expected float32 or bfloat16, got ", dtype);
  return f(float{});
}

}  // namespace iterserve
