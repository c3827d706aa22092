// Paged prefill attention on the CPU: each multi-query request of a step (a fresh prompt, a chunk of a
// longer one, a recompute) attends causally to its whole context straight from the paged K/V cache, fp32
// online softmax, K/V widened to fp32 as they are read (bf16.h). Built and loaded by
// kernels/cpu_paged_attention.py, which says why it exists.
//
// The work is cut into items of one KV head and a tile of up to kTileQ query tokens: the tile's query rows
// (its tokens times the GQA heads sharing that KV head) stay in L1/L2 as fp32 while the context streams
// past in tiles of kTileK keys. Per tile, S = Q K^T and acc += P V are register-blocked outer products
// (one K^T or V row loaded, broadcast query or probability values, many accumulators), which is what
// lets head_dim 64 run near the FMA units' rate where torch's SDPA on CPU ran its small GEMMs at ~50
// GFLOP/s a core. In bf16 on a CPU with AVX512-BF16 both products run on bf16 dot products (kPairDot):
// ~165 GFLOP/s a core against ~115 with fp32 FMAs, p rounded to bf16 for p.V as torch's bf16 SDPA
// rounds it (tests/test_cpu_prefill_attention.py holds the error to SDPA's).

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_tiles.h"
#include "bf16.h"
#include "vec_exp.h"

namespace {

using iterserve::load;
using namespace iterserve::prefill;

constexpr int64_t kTileQ = 32;  // query tokens of one item: 96 query rows at GQA 3, ~24 KiB of fp32 each for q and acc

struct Dims {
  int64_t num_heads, group, head_dim, block_size, slot_stride, q_stride;
};

struct Item {
  int64_t request, tile_start, tile_len, kv_head, work;
};

// Per-thread scratch: the item's scaled query rows and accumulators, one key tile's K^T and V in fp32,
// its scores, and each row's running max and sum.
struct Scratch {
  std::vector<float> q, acc, kt, v, s, max, sum;
  // the bf16 dot-product form's q rows and K^T (pairs of bf16 along D), p rows and V (pairs along keys)
  std::vector<uint32_t> qp, ktp, pp, vp;
  Scratch(const Dims& d)
      : q(kTileQ * d.group * d.head_dim), acc(kTileQ * d.group * d.head_dim), kt(d.head_dim * kTileK),
        v(kTileK * d.head_dim), s(kTileQ * d.group * kTileK), max(kTileQ * d.group), sum(kTileQ * d.group),
        qp(kTileQ * d.group * d.head_dim / 2), ktp(d.head_dim / 2 * kTileK), pp(kTileQ * d.group * kTileK / 2),
        vp(kTileK / 2 * d.head_dim) {}
};


// One item: query tokens [i0, i0 + m) of a request whose chunk holds the last n of its ctx tokens, the
// GQA heads of KV head h, against blocks [0, last needed) of its table. Row r = token * G + head.
template <int64_t kD, typename T>
void attend_item(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t ctx, int64_t n,
                 int64_t i0, int64_t m, int64_t h, float scale, const Dims& dm, Scratch& w, T* out,
                 int64_t out_stride) {
  const int64_t G = dm.group, D = kD ? kD : dm.head_dim, bs = dm.block_size, R = m * G;
  const float lo = iterserve::kExpLo, hi = iterserve::kExpHi;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      const T* src = q + (i0 + i) * dm.q_stride + (h * G + g) * D;
      if constexpr (kPairDot<T, kD>) {
        std::memcpy(&w.qp[(i * G + g) * D / 2], src, D * sizeof(T));
      } else {
        float* dst = &w.q[(i * G + g) * D];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) dst[d] = scale * load(src[d]);
      }
    }
  }
  std::fill(w.acc.begin(), w.acc.begin() + R * D, 0.f);
  std::fill(w.max.begin(), w.max.begin() + R, -std::numeric_limits<float>::infinity());
  std::fill(w.sum.begin(), w.sum.begin() + R, 0.f);

  const int64_t first_pos = ctx - n + i0;      // position of the item's first query token
  const int64_t key_end = first_pos + m;       // keys [0, key_end) are seen by some row of the item
  for (int64_t k0 = 0; k0 < key_end; k0 += kTileK) {
    const int64_t nb = std::min(kTileK, key_end - k0);
    // K^T and V of this tile and head in fp32, key by key through the block table; K^T's columns past
    // nb are zero (their scores are masked)
    for (int64_t t = 0; t < kTileK; ++t) {
      if (t < nb) {
        const int64_t key = k0 + t, row = (table[key / bs] * bs + key % bs) * dm.slot_stride + h * D;
        const T* krow = k_cache + row;
        const T* vrow = v_cache + row;
        if constexpr (kPairDot<T, kD>) {
          uint32_t pairs[kD / 2];
          std::memcpy(pairs, krow, kD * sizeof(T));
          for (int64_t i = 0; i < kD / 2; ++i) w.ktp[i * kTileK + t] = pairs[i];
        } else {
          for (int64_t d = 0; d < D; ++d) w.kt[d * kTileK + t] = load(krow[d]);
        }
        if constexpr (kPairDot<T, kD>) {
          const uint16_t* bits = reinterpret_cast<const uint16_t*>(vrow);
          uint32_t* dst = &w.vp[(t / 2) * kD];
          // key 2i in the low half of pair i, key 2i + 1 in the high; writing the low half clears the
          // high one, so the pair of an odd nb's last key holds no stale key (p is 0 there, but 0 times a
          // stale value is 0 only while that value is finite)
          if (t % 2 == 0) {
#pragma omp simd
            for (int64_t d = 0; d < kD; ++d) dst[d] = bits[d];
          } else {
#pragma omp simd
            for (int64_t d = 0; d < kD; ++d) dst[d] |= static_cast<uint32_t>(bits[d]) << 16;
          }
        } else {
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) w.v[t * D + d] = load(vrow[d]);
        }
      } else if constexpr (kPairDot<T, kD>) {
        for (int64_t i = 0; i < kD / 2; ++i) w.ktp[i * kTileK + t] = 0;
      } else {
        for (int64_t d = 0; d < D; ++d) w.kt[d * kTileK + t] = 0.f;
      }
    }
#if defined(__AVX512BF16__)
    if constexpr (kPairDot<T, kD>) scores_pairs<kD>(w.qp.data(), R, w.ktp.data(), scale, w.s.data());
    else
#endif
      scores<kD>(w.q.data(), R, w.kt.data(), D, w.s.data());
    for (int64_t r = 0; r < R; ++r) {
      // keys up to the row's own position: the first `valid` of this block
      const int64_t valid = std::min(nb, first_pos + r / G - k0 + 1);
      float* p = &w.s[r * kTileK];
      if (valid <= 0) {
        std::fill(p, p + kTileK, 0.f);
        if constexpr (kPairDot<T, kD>) std::fill(&w.pp[r * (kTileK / 2)], &w.pp[(r + 1) * (kTileK / 2)], 0u);
        continue;
      }
      const float new_max = std::max(w.max[r], row_max(p, valid));
      float block_sum = 0.f;
      // over the whole tile, masked keys zeroed: a loop GCC vectorizes, which one that stops at `valid`
      // is not always
#pragma omp simd reduction(+ : block_sum)
      for (int64_t t = 0; t < kTileK; ++t) {
        const float e = t < valid ? iterserve::exp_approx(p[t] - new_max, lo, hi) : 0.f;
        p[t] = e;
        block_sum += e;
      }
      const float correction = std::exp(w.max[r] - new_max);  // 0 on the first block (max = -inf)
      if (correction != 1.f) {
        float* a = &w.acc[r * D];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] *= correction;
      }
      w.sum[r] = w.sum[r] * correction + block_sum;
      w.max[r] = new_max;
#if defined(__AVX512BF16__)
      if constexpr (kPairDot<T, kD>) {  // p in bf16 pairs, rounded to nearest even
        for (int64_t t = 0; t < kTileK; t += 32) {
          const __m512bh two = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + t + 16), _mm512_loadu_ps(p + t));
          _mm512_storeu_si512(&w.pp[r * (kTileK / 2) + t / 2], (__m512i)two);
        }
      }
#endif
    }
#if defined(__AVX512BF16__)
    if constexpr (kPairDot<T, kD>) apply_pairs<kD>(w.acc.data(), R, w.vp.data(), (nb + 1) / 2, w.pp.data());
    else
#endif
      apply<kD>(w.acc.data(), R, w.v.data(), nb, D, w.s.data());
  }
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g;
      const float inv = 1.f / w.sum[r];
      T* dst = out + (i0 + i) * out_stride + (h * G + g) * D;
      const float* a = &w.acc[r * D];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) iterserve::store(&dst[d], inv * a[d]);
    }
  }
}

template <typename T>
void attend(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t ctx, int64_t n,
            int64_t i0, int64_t m, int64_t h, float scale, const Dims& dm, Scratch& w, T* out, int64_t out_stride) {
  switch (dm.head_dim) {
    case 64: return attend_item<64>(q, k_cache, v_cache, table, ctx, n, i0, m, h, scale, dm, w, out, out_stride);
    case 128: return attend_item<128>(q, k_cache, v_cache, table, ctx, n, i0, m, h, scale, dm, w, out, out_stride);
    default: return attend_item<0>(q, k_cache, v_cache, table, ctx, n, i0, m, h, scale, dm, w, out, out_stride);
  }
}

}  // namespace

// q: [T, num_heads, head_dim] (rows may be strided, heads and dims contiguous), the step's queries; out:
// the same shape, contiguous, written at the multi-query requests' rows only. Request j owns rows
// [starts[j], starts[j] + num_query[j]), the last num_query[j] of its context_lens[j] tokens, whose
// K/V are in the caches ([num_blocks * block_size, num_kv_heads, head_dim]) through block_tables[j].
// q, out and the caches all float32 or all bfloat16.
void paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& starts_in, const at::Tensor& num_query_in,
                             const at::Tensor& context_lens_in, const at::Tensor& block_tables_in,
                             int64_t block_size, double scale, at::Tensor& out) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() && out.device().is_cpu(),
              "paged_prefill_attention: CPU tensors only");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype && out.scalar_type() == dtype,
              "paged_prefill_attention: q, out and the caches must share a dtype");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && out.sizes() == q.sizes(), "q, out and the caches must be 3-D");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "the caches must be contiguous and of one shape");
  TORCH_CHECK(out.is_contiguous(), "out must be contiguous");
  const int64_t num_heads = q.size(1), head_dim = q.size(2), num_kv_heads = k_cache.size(1);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == head_dim, "q's heads and dims must be contiguous");
  TORCH_CHECK(k_cache.size(2) == head_dim && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "q and the caches differ in head_dim, or num_heads is not a multiple of num_kv_heads");
  TORCH_CHECK(block_size > 0 && k_cache.size(0) % block_size == 0, "the caches' rows must be whole blocks");
  const at::Tensor starts = starts_in.to(at::kLong).contiguous(), num_query = num_query_in.to(at::kLong).contiguous();
  const at::Tensor lens = context_lens_in.to(at::kLong).contiguous();
  const at::Tensor tables = block_tables_in.to(at::kLong).contiguous();
  const int64_t m = starts.size(0), width = tables.dim() == 2 ? tables.size(1) : 0;
  TORCH_CHECK(num_query.size(0) == m && lens.size(0) == m && tables.dim() == 2 && tables.size(0) == m,
              "starts, num_query, context_lens and block_tables must describe the same requests");
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t* np = num_query.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t num_blocks = k_cache.size(0) / block_size;

  // Checked on one thread, so the kernel's loads need no checks; items made longest first, which the
  // shared counter below then hands out greedily (the causal mask makes a chunk's late tiles the long ones).
  std::vector<Item> items;
  for (int64_t j = 0; j < m; ++j) {
    TORCH_CHECK(np[j] >= 1 && np[j] <= lp[j] && lp[j] <= width * block_size && sp[j] >= 0 && sp[j] + np[j] <= q.size(0),
                "request ", j, ": rows or context outside the step or its block table");
    for (int64_t b = 0; b < (lp[j] + block_size - 1) / block_size; ++b) {
      TORCH_CHECK(tp[j * width + b] >= 0 && tp[j * width + b] < num_blocks, "block id ", tp[j * width + b],
                  " is outside the cache");
    }
    for (int64_t i0 = 0; i0 < np[j]; i0 += kTileQ) {
      const int64_t len = std::min(kTileQ, np[j] - i0), keys = lp[j] - np[j] + i0 + len;
      for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({j, i0, len, h, len * keys});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.work > b.work; });

  const Dims dm{num_heads, num_heads / num_kv_heads, head_dim, block_size, num_kv_heads * head_dim, q.stride(0)};
  const float fscale = static_cast<float>(scale);
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t num_tasks = std::max<int64_t>(1, std::min<int64_t>(num_items, at::get_num_threads()));
  iterserve::dispatch(dtype, "paged_prefill_attention", [&](auto tag) {
    using T = decltype(tag);
    const T* qp = iterserve::data<const T>(q);
    const T* kp = iterserve::data<const T>(k_cache);
    const T* vp = iterserve::data<const T>(v_cache);
    T* op = iterserve::data<T>(out);
    std::atomic<int64_t> next{0};
    at::parallel_for(0, num_tasks, 1, [&](int64_t, int64_t) {  // the counter, not the range, splits
      Scratch scratch(dm);
      for (int64_t k = next++; k < num_items; k = next++) {
        const Item& it = items[k];
        const int64_t j = it.request;
        attend<T>(qp + sp[j] * dm.q_stride, kp, vp, tp + j * width, lp[j], np[j], it.tile_start, it.tile_len,
                  it.kv_head, fscale, dm, scratch, op + sp[j] * num_heads * head_dim, num_heads * head_dim);
      }
    });
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released: the engine loop runs in a background thread next to the HTTP server's.
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "Causal prefill attention of a step's multi-query requests from the paged K/V cache (CPU, float32 or bfloat16)",
        py::call_guard<py::gil_scoped_release>());
}
