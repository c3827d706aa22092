// Paged decode attention on the CPU: one query token per request, read straight from the paged K/V
// cache through the request's block table (no gathered copy), fp32 online softmax. q and the caches are
// float32 or bfloat16 (bf16.h), all of one dtype: K and V rows are widened to fp32 as they are loaded, so
// a bf16 cache halves the bytes read, and scores, softmax and accumulators stay fp32. Built and loaded
// by kernels/cpu_paged_attention.py, which says why it exists.

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

#include "bf16.h"
#include "c_api.h"
#include "decode_tiles.h"
#include "vec_exp.h"

namespace {

using iterserve::bf16;
using iterserve::load;
using namespace iterserve::decode;

// Multiply-adds (per q.k or per p*v pass) below which a task is not worth a thread: torch's grain for
// elementwise ops (at::internal::GRAIN_SIZE), an estimate here, not a measurement.
constexpr int64_t kMinWorkPerTask = 32768;

// Every cache line of [p, p + count).
template <typename T>
inline void prefetch(const T* p, int64_t count) {
  constexpr int64_t kPerLine = 64 / sizeof(T);
  for (int64_t i = 0; i < count; i += kPerLine) __builtin_prefetch(p + i);
}

struct Shape {
  int64_t group, head_dim, num_kv_heads, block_size, table_width;
};

// Per-task scratch, allocated once per task rather than per item: the item's query heads (scaled),
// their accumulators, one block's scores, and each head's running max and sum.
struct Scratch {
  std::vector<float> q, acc, scores, max, sum;
  Scratch(const Shape& s, int64_t heads)
      : q(heads * s.head_dim), acc(heads * s.head_dim), scores(heads * s.block_size), max(heads), sum(heads) {}
};

// The query heads of KV heads [h0, h1) of one request against its `len` cached tokens, one cache block
// at a time. Blocks are the outer loop: a block's K rows (then its V rows) for every KV head of the item
// lie in one contiguous stretch of the cache, so the kernel streams it front to back instead of reading
// a third of each row per pass. A block's scores stay in L1; the running max is raised and the
// accumulators rescaled once per block rather than once per token.
template <int64_t kD, typename T>
void attend_d(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t len,
              int64_t h0, int64_t h1, float scale, const Shape& s, Scratch& w, T* out) {
  const int64_t G = s.group, D = kD ? kD : s.head_dim, bs = s.block_size;
  const int64_t rows = (h1 - h0) * G;  // query heads of this item, in order
  const int64_t slot_stride = s.num_kv_heads * D;
  const float lo = iterserve::kExpLo, hi = iterserve::kExpHi;
  for (int64_t r = 0; r < rows; ++r) scale_into(&w.q[r * D], scale, q + r * D, D);
  std::fill(w.acc.begin(), w.acc.begin() + rows * D, 0.f);
  std::fill(w.max.begin(), w.max.begin() + rows, -std::numeric_limits<float>::infinity());
  std::fill(w.sum.begin(), w.sum.begin() + rows, 0.f);

  const int64_t num_blocks = (len + bs - 1) / bs;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t n = std::min(bs, len - b * bs);
    const int64_t base = table[b] * bs * slot_stride + h0 * D;
    const int64_t span = (n - 1) * slot_stride + (h1 - h0) * D;  // elements from the block's first row read
    // V's rows of this block are fetched while its scores are computed, and the next block's K rows
    // while V is applied: the hardware prefetcher does not follow a block table.
    prefetch(v_cache + base, span);
    for (int64_t h = 0; h < h1 - h0; ++h) {
#if defined(__AVX512BF16__)
      if constexpr (kPairScores<T, kD>) {
        for_row_chunks<3>(G, [&](int64_t r, auto rows) {
          scores_rows_pairs<kD, decltype(rows)::value>(q + (h * G + r) * kD, k_cache + base + h * D, n,
                                                       slot_stride, scale, &w.scores[(h * G + r) * bs], bs);
        });
        continue;
      }
#endif
      block_scores<kD>(&w.q[h * G * D], G, k_cache + base + h * D, n, slot_stride, D, &w.scores[h * G * bs], bs);
    }
    if (b + 1 < num_blocks) {
      prefetch(k_cache + table[b + 1] * bs * slot_stride + h0 * D, (std::min(bs, len - (b + 1) * bs) - 1) * slot_stride + (h1 - h0) * D);
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* p = &w.scores[r * bs];
      const float new_max = std::max(w.max[r], max_of(p, n));
      float block_sum = 0.f;
      // vectorized exp: a scalar libm exp per score took most of the kernel's time
#pragma omp simd reduction(+ : block_sum)
      for (int64_t t = 0; t < n; ++t) {
        p[t] = iterserve::exp_approx(p[t] - new_max, lo, hi);
        block_sum += p[t];
      }
      // once the max has settled, most blocks leave it be: no rescale, and no scalar exp to find that out
      if (new_max != w.max[r]) {
        const float correction = std::exp(w.max[r] - new_max);  // 0 on the first block (max = -inf)
        scale_into(&w.acc[r * D], correction, &w.acc[r * D], D);
        w.sum[r] *= correction;
        w.max[r] = new_max;
      }
      w.sum[r] += block_sum;
    }
    for (int64_t h = 0; h < h1 - h0; ++h) {
      block_apply<kD>(&w.acc[h * G * D], G, v_cache + base + h * D, n, slot_stride, D, &w.scores[h * G * bs], bs);
    }
  }
#if defined(__AVX512BF16__)
  if constexpr (kPairApply<T, kD>) {
    if (bs <= kMaxPairBlock) {  // block_apply ran apply_rows_pairs, which keeps acc in its lane order
      for (int64_t r = 0; r < rows; ++r) unpermute_pairs<kD>(&w.acc[r * D]);
    }
  }
#endif
  for (int64_t r = 0; r < rows; ++r) scale_into(out + r * D, 1.f / w.sum[r], &w.acc[r * D], D);
}

template <typename T>
void attend(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t len,
            int64_t h0, int64_t h1, float scale, const Shape& s, Scratch& w, T* out) {
  switch (s.head_dim) {
    case 64: return attend_d<64>(q, k_cache, v_cache, table, len, h0, h1, scale, s, w, out);
    case 128: return attend_d<128>(q, k_cache, v_cache, table, len, h0, h1, scale, s, w, out);
    default: return attend_d<0>(q, k_cache, v_cache, table, len, h0, h1, scale, s, w, out);
  }
}

// Schedules the items of a batch over torch's threads (see paged_decode_attention).
template <typename T>
void run(const T* qp, const T* kp, const T* vp, const int64_t* tables, const int64_t* lens, int64_t total_tokens,
         int64_t n, int64_t num_heads, float fscale, const Shape& shape, T* op) {
  const int64_t num_kv_heads = shape.num_kv_heads, head_dim = shape.head_dim;
  // Items are handed out one at a time from a shared counter: requests differ in length, and an even
  // split of the item range would leave one thread with all the long ones. An item is a whole request
  // (all its KV heads: one pass over its blocks) when there are as many requests as threads, else one
  // KV head of a request, so that a lone long request still uses every thread. Fewer tasks than threads
  // when the work is too small to pay for waking them.
  const int64_t threads = at::get_num_threads();
  const int64_t heads_per_item = n >= threads ? num_kv_heads : 1;
  const int64_t items_per_request = num_kv_heads / heads_per_item;
  const int64_t items = n * items_per_request;
  const int64_t work = total_tokens * num_heads * head_dim;
  const int64_t num_tasks = std::max<int64_t>(1, std::min({items, threads, work / kMinWorkPerTask}));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, num_tasks, 1, [&](int64_t, int64_t) {  // the counter, not the range, splits
    Scratch scratch(shape, heads_per_item * shape.group);
    for (int64_t item = next++; item < items; item = next++) {
      const int64_t r = item / items_per_request, h0 = (item % items_per_request) * heads_per_item;
      const int64_t offset = (r * num_heads + h0 * shape.group) * head_dim;
      attend(qp + offset, kp, vp, tables + r * shape.table_width, lens[r], h0, h0 + heads_per_item, fscale,
             shape, scratch, op + offset);
    }
  });
}

}  // namespace

// q: [n, num_heads, head_dim]; k_cache, v_cache: [num_blocks * block_size, num_kv_heads, head_dim], all
// three float32 or all bfloat16; block_tables: [n, width] (columns past a request's context are never
// read); context_lens: [n], each in [1, width * block_size]. Returns [n, num_heads, head_dim] in q's dtype.
at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables_in,
                                  const at::Tensor& context_lens_in, int64_t block_size,
                                  double scale) {
  TORCH_CHECK(q_in.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(k_cache.scalar_type() == q_in.scalar_type() && v_cache.scalar_type() == q_in.scalar_type(),
              "paged_decode_attention: q, k_cache and v_cache must share a dtype, got ", q_in.scalar_type(), ", ",
              k_cache.scalar_type(), ", ", v_cache.scalar_type());
  TORCH_CHECK(q_in.dim() == 3 && k_cache.dim() == 3, "q and the caches must be 3-D");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache differ in shape");
  // A copy of a whole cache would cost more than the attention: the caller must pass them as they are.
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  const at::Tensor q = q_in.contiguous();
  const at::Tensor block_tables = block_tables_in.to(at::kLong).contiguous();
  const at::Tensor context_lens = context_lens_in.to(at::kLong).contiguous();

  const int64_t n = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == head_dim, "q and the caches differ in head_dim");
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_size > 0 && k_cache.size(0) % block_size == 0,
              "the caches' rows must be whole blocks");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == n, "block_tables must be [n, width]");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == n, "context_lens must be [n]");
  const Shape shape{num_heads / num_kv_heads, head_dim, num_kv_heads, block_size,
                    block_tables.size(1)};

  // Checked here, on one thread, so the kernel's loads need no checks: a bad length or block id
  // raises like the torch path's index_select instead of reading outside the cache.
  const int64_t num_blocks = k_cache.size(0) / block_size;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  int64_t total_tokens = 0;
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(lens[r] >= 1 && lens[r] <= shape.table_width * block_size,
                "context_lens[", r, "] = ", lens[r], " is outside [1, width * block_size]");
    for (int64_t b = 0; b < (lens[r] + block_size - 1) / block_size; ++b) {
      const int64_t id = tables[r * shape.table_width + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block id ", id, " is outside the cache");
    }
    total_tokens += lens[r];
  }

  at::Tensor out = at::empty_like(q);
  const float fscale = static_cast<float>(scale);
  iterserve::dispatch(q.scalar_type(), "paged_decode_attention", [&](auto dtype) {
    using T = decltype(dtype);
    run<T>(iterserve::data<const T>(q), iterserve::data<const T>(k_cache), iterserve::data<const T>(v_cache),
           tables, lens, total_tokens, n, num_heads, fscale, shape, iterserve::data<T>(out));
  });
  return out;
}

// k_cache[slots[i]] = k[i], v_cache[slots[i]] = v[i] for the step's new tokens (k, v: [n, num_kv_heads,
// head_dim]). torch's index_copy_ took ~50 us a layer for a decode step of 64 rows; this is a few.
void write_kv(const at::Tensor& k_in, const at::Tensor& v_in, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slots_in) {
  TORCH_CHECK(k_in.scalar_type() == k_cache.scalar_type() && v_in.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16),
              "write_kv: k, v and the caches must all be float32 or all bfloat16");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "write_kv: the caches must be contiguous");
  TORCH_CHECK(k_in.sizes() == v_in.sizes() && k_in.dim() == 3 && k_in.size(1) == k_cache.size(1) &&
                  k_in.size(2) == k_cache.size(2),
              "write_kv: k and v must be [n, num_kv_heads, head_dim] like the caches' rows");
  // k and v are column slices of the qkv projection's output: each row's heads lie contiguous, the rows
  // a qkv row apart. Rows are copied from where they lie, with no contiguous copy first (two torch copies
  // a layer, each a dispatch and a thread fork, cost more than this whole write at decode).
  const auto rows_in_place = [](const at::Tensor& t) {
    return t.stride(2) == 1 && t.stride(1) == t.size(2) ? t : t.contiguous();
  };
  const at::Tensor k = rows_in_place(k_in), v = rows_in_place(v_in);
  const at::Tensor slots = slots_in.to(at::kLong).contiguous();
  const int64_t n = k.size(0), row = k.size(1) * k.size(2), num_slots = k_cache.size(0);
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == n, "write_kv: slots must be [n]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(sp[i] >= 0 && sp[i] < num_slots, "write_kv: slot ", sp[i], " is outside the cache");
  }
  // a copy of bytes: the dtype only sets a row's size
  const int64_t row_bytes = row * k.element_size();
  const int64_t k_pitch = k.stride(0) * k.element_size(), v_pitch = v.stride(0) * v.element_size();
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  at::parallel_for(0, n, std::max<int64_t>(1, kMinWorkPerTask / (2 * row)), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(kc + sp[i] * row_bytes, kp + i * k_pitch, row_bytes);
      std::memcpy(vc + sp[i] * row_bytes, vp + i * v_pitch, row_bytes);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  static const iterserve::c_api::Attention api{iterserve::c_api::kVersion, &paged_decode_attention, &write_kv};
  m.attr("c_api") = iterserve::c_api::capsule_of(api);
  // The GIL is released: the engine loop runs in a background thread next to the HTTP server's.
  m.def("paged_decode_attention", &paged_decode_attention,
        "Paged decode attention from the paged K/V cache (CPU, float32 or bfloat16)",
        py::call_guard<py::gil_scoped_release>());
  m.def("write_kv", &write_kv, "Write the step's new K/V rows into their cache slots (CPU, float32 or bfloat16)",
        py::call_guard<py::gil_scoped_release>());
}
