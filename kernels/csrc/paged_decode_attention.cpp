// Paged decode attention on the CPU: one query token per request, read straight from the paged K/V
// cache through the request's block table (no gathered copy), fp32 online softmax. Built and loaded by
// kernels/cpu_paged_attention.py, which says why it exists.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// Tokens scored before their weights are applied: the running max is raised and the accumulators
// rescaled once per chunk rather than once per token, and a chunk's scores stay in L1.
constexpr int64_t kChunk = 32;

// Multiply-adds (per q.k or per p*v pass) below which a task is not worth a thread: torch's grain for
// elementwise ops (at::internal::GRAIN_SIZE), an estimate here, not a measurement.
constexpr int64_t kMinWorkPerTask = 32768;

// The head_dim loops are `omp simd` so GCC vectorizes the reduction too (it may reorder the sum; plain
// -O3 would not, since float addition is not associative). -march=native picks the vector width.
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* __restrict y, float a, const float* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

inline void scale_into(float* __restrict y, float a, const float* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = a * x[i];
}

struct Shape {
  int64_t group, head_dim, num_kv_heads, block_size, table_width;
};

// Per-task scratch, allocated once per task rather than per (request, kv head).
struct Scratch {
  std::vector<float> q, acc, scores, max, sum;
  std::vector<int64_t> rows;
  explicit Scratch(const Shape& s)
      : q(s.group * s.head_dim), acc(s.group * s.head_dim), scores(s.group * kChunk),
        max(s.group), sum(s.group), rows(kChunk) {}
};

// The `group` query heads of one KV head of one request against its `len` cached tokens.
void attend(const float* q, const float* k_cache, const float* v_cache, const int64_t* table,
            int64_t len, int64_t kv_head, float scale, const Shape& s, Scratch& w, float* out) {
  const int64_t G = s.group, D = s.head_dim, bs = s.block_size;
  const int64_t slot_stride = s.num_kv_heads * D;
  for (int64_t g = 0; g < G; ++g) scale_into(&w.q[g * D], scale, q + g * D, D);
  std::fill(w.acc.begin(), w.acc.end(), 0.f);
  std::fill(w.max.begin(), w.max.end(), -std::numeric_limits<float>::infinity());
  std::fill(w.sum.begin(), w.sum.end(), 0.f);

  for (int64_t start = 0; start < len; start += kChunk) {
    const int64_t n = std::min(kChunk, len - start);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = start + i;
      w.rows[i] = (table[t / bs] * bs + t % bs) * slot_stride + kv_head * D;
    }
    // Token-major, so each K row is read from memory once for all the group's heads.
    for (int64_t i = 0; i < n; ++i) {
      const float* k = k_cache + w.rows[i];
      for (int64_t g = 0; g < G; ++g) w.scores[g * kChunk + i] = dot(&w.q[g * D], k, D);
    }
    for (int64_t g = 0; g < G; ++g) {
      float* p = &w.scores[g * kChunk];
      const float new_max = std::max(w.max[g], *std::max_element(p, p + n));
      float chunk_sum = 0.f;
      for (int64_t i = 0; i < n; ++i) {
        p[i] = std::exp(p[i] - new_max);
        chunk_sum += p[i];
      }
      const float correction = std::exp(w.max[g] - new_max);  // 0 on the first chunk (max = -inf)
      if (correction != 1.f) scale_into(&w.acc[g * D], correction, &w.acc[g * D], D);
      w.sum[g] = w.sum[g] * correction + chunk_sum;
      w.max[g] = new_max;
    }
    for (int64_t i = 0; i < n; ++i) {
      const float* v = v_cache + w.rows[i];
      for (int64_t g = 0; g < G; ++g) axpy(&w.acc[g * D], w.scores[g * kChunk + i], v, D);
    }
  }
  for (int64_t g = 0; g < G; ++g) scale_into(out + g * D, 1.f / w.sum[g], &w.acc[g * D], D);
}

}  // namespace

// q: [n, num_heads, head_dim]; k_cache, v_cache: [num_blocks * block_size, num_kv_heads, head_dim];
// block_tables: [n, width] (columns past a request's context are never read); context_lens: [n], each
// in [1, width * block_size]. Returns [n, num_heads, head_dim].
at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables_in,
                                  const at::Tensor& context_lens_in, int64_t block_size,
                                  double scale) {
  TORCH_CHECK(q_in.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat,
              "paged_decode_attention: float32 only");
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
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  // (request, kv head) items are handed out one at a time from a shared counter: requests differ in
  // length, and an even split of the item range would leave one thread with all the long ones.
  // Fewer tasks than threads when the work is too small to pay for waking them.
  const int64_t items = n * num_kv_heads;
  const int64_t work = total_tokens * num_heads * head_dim;
  const int64_t num_tasks = std::max<int64_t>(
      1, std::min({items, static_cast<int64_t>(at::get_num_threads()),
                   work / kMinWorkPerTask}));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, num_tasks, 1, [&](int64_t, int64_t) {  // the counter, not the range, splits
    Scratch scratch(shape);
    for (int64_t item = next++; item < items; item = next++) {
      const int64_t r = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t offset = (r * num_heads + h * shape.group) * head_dim;
      attend(qp + offset, kp, vp, tables + r * shape.table_width, lens[r], h, fscale, shape, scratch,
             op + offset);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released: the engine loop runs in a background thread next to the HTTP server's.
  m.def("paged_decode_attention", &paged_decode_attention,
        "Paged decode attention from the paged K/V cache (CPU, float32)",
        py::call_guard<py::gil_scoped_release>());
}
