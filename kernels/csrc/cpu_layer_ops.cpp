// A Llama layer's elementwise ops on the CPU, each one pass over its rows: residual add + RMSNorm, SwiGLU,
// and rotate-half rotary applied in place; and the greedy sampler's row argmax (first_max). Built and loaded by kernels/cpu_layer_ops.py, which says why
// they exist. float32 or bfloat16 tensors (bf16.h): fp32 arithmetic inside, each result rounded once on
// store.
//
// Built with -ffp-contract=off: without fused multiply-adds the float32 add and rotary round exactly as
// torch's separate ops do, so they match the torch path bit for bit (and the bf16 residual add matches
// torch's bf16 add).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>

#include "bf16.h"
#include "c_api.h"
#include "vec_exp.h"

namespace {

using iterserve::bf16;
using iterserve::load;
using iterserve::store;

// Elements below which a task is not worth a thread: torch's grain for elementwise ops
// (at::internal::GRAIN_SIZE). A decode step's few rows stay on the calling thread, where an OpenMP
// fork would cost more than the work.
constexpr int64_t kMinWorkPerTask = 32768;

int64_t grain(int64_t work_per_row) {
  return std::max<int64_t>(1, kMinWorkPerTask / std::max<int64_t>(1, work_per_row));
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, ": expected a CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": expected [rows, cols] with contiguous columns, got ",
              t.sizes());
}

void check_float32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, ": expected float32, got ", t.scalar_type());
}

using iterserve::exp_approx;
using iterserve::kExpHi;
using iterserve::kExpLo;

// T: x's and the residual's element type; W: the weight's (float, or T).
template <typename T, typename W>
void add_rms_norm_rows(const torch::Tensor& x, const std::optional<torch::Tensor>& residual,
                       const torch::Tensor& weight, float eps, torch::Tensor& out) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  const bool has_residual = residual.has_value();
  const T* xp = iterserve::data<const T>(x);
  T* rp = has_residual ? iterserve::data<T>(*residual) : nullptr;
  const W* w = iterserve::data<const W>(weight);
  T* op = iterserve::data<T>(out);
  const int64_t xs = x.stride(0), rs = has_residual ? residual->stride(0) : 0;
  at::parallel_for(0, rows, grain(2 * hidden), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* xi = xp + i * xs;
      T* o = op + i * hidden;
      const T* src = xi;
      float ss = 0.f;
      if (has_residual) {
        T* r = rp + i * rs;
        // the norm reads the sum as stored (rounded to T), as the next layer will
#pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < hidden; ++j) {
          // stored by rounding s again, which leaves it as it is: assigning the rounded T instead
          // made GCC's bf16 loop 6x slower
          const float s = load(iterserve::from_float<T>(load(xi[j]) + load(r[j])));
          store(&r[j], s);
          ss += s * s;
        }
        src = r;
      } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < hidden; ++j) ss += load(xi[j]) * load(xi[j]);
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(hidden) + eps);
#pragma omp simd
      for (int64_t j = 0; j < hidden; ++j) store(&o[j], load(src[j]) * inv * load(w[j]));
    }
  });
}

template <typename T>
void silu_and_mul_rows(const torch::Tensor& gate_up, torch::Tensor& out) {
  const int64_t rows = gate_up.size(0), d = gate_up.size(1) / 2;
  const T* gp = iterserve::data<const T>(gate_up);
  T* op = iterserve::data<T>(out);
  const int64_t gs = gate_up.stride(0);
  const float lo = kExpLo, hi = kExpHi;
  at::parallel_for(0, rows, grain(2 * d), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* g = gp + i * gs;
      const T* u = g + d;
      T* o = op + i * d;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) {
        const float gj = load(g[j]);
        store(&o[j], gj / (1.f + exp_approx(-gj, lo, hi)) * load(u[j]));
      }
    }
  });
}

// T: qk's element type; the cos/sin caches are float32 whatever it is.
template <typename T>
void rotary_rows(torch::Tensor& qk, const int64_t* pp, const torch::Tensor& cos_cache,
                 const torch::Tensor& sin_cache) {
  const int64_t tokens = qk.size(0), heads = qk.size(1), head_dim = qk.size(2), half = head_dim / 2;
  T* base = iterserve::data<T>(qk);
  const float* cp = cos_cache.const_data_ptr<float>();
  const float* sp = sin_cache.const_data_ptr<float>();
  const int64_t ts = qk.stride(0), hs = qk.stride(1), cs = cos_cache.stride(0), ss = sin_cache.stride(0);
  at::parallel_for(0, tokens, grain(heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + pp[t] * cs;
      const float* s = sp + pp[t] * ss;
      for (int64_t h = 0; h < heads; ++h) {
        T* x = base + t * ts + h * hs;
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          const float x1 = load(x[j]), x2 = load(x[j + half]);
          store(&x[j], x1 * c[j] - x2 * s[j]);
          store(&x[j + half], x2 * c[j + half] + x1 * s[j + half]);
        }
      }
    }
  });
}

// The index of x's first maximum, as torch's max(dim=-1).indices takes it: the first of equal maxima
// (-0 equals +0), and a NaN above everything (its first one wins). One pass of vectorized max and NaN
// reductions over chunks that fit in L1, then a scan of the winning chunk for the first index holding
// its maximum: the index tracking does not vectorize, so it runs over one chunk, not the row.
template <typename T>
int64_t first_max_index(const T* x, int64_t n) {
  constexpr int64_t kChunk = 2048;
  float best = 0.f;
  int64_t best_chunk = -1;
  for (int64_t c = 0; c < n; c += kChunk) {
    const int64_t e = std::min(n, c + kChunk);
    float m = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (int64_t i = c; i < e; ++i) {
      const float v = load(x[i]);
      m = v > m ? v : m;
      nan |= v != v;
    }
    if (nan) {
      for (int64_t i = c;; ++i)
        if (load(x[i]) != load(x[i])) return i;
    }
    if (best_chunk < 0 || m > best) {
      best = m;
      best_chunk = c;
    }
  }
  for (int64_t i = best_chunk;; ++i)
    if (load(x[i]) == best) return i;
}

}  // namespace

// residual := x + residual, out := rmsnorm(residual) * weight; without a residual, out := rmsnorm(x).
// x and the residual: float32 or bfloat16, one dtype; the weight float32 or x's dtype. fp32 inside,
// each result rounded once to x's dtype. Returns (out, the residual stream): the residual is updated
// in place (the layer stream owns it), x is only read.
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x,
                                                      const std::optional<torch::Tensor>& residual,
                                                      const torch::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm x");
  const int64_t rows = x.size(0), hidden = x.size(1);
  const auto dtype = x.scalar_type();
  TORCH_CHECK((weight.scalar_type() == torch::kFloat32 || weight.scalar_type() == dtype) && weight.dim() == 1 &&
                  weight.size(0) == hidden && weight.is_contiguous() && weight.device().is_cpu(),
              "add_rms_norm weight: expected a contiguous [", hidden, "] in float32 or x's dtype");
  if (residual.has_value()) {
    check_rows(*residual, "add_rms_norm residual");
    TORCH_CHECK(residual->scalar_type() == dtype, "add_rms_norm residual: dtype ", residual->scalar_type(),
                " differs from x's ", dtype);
    TORCH_CHECK(residual->sizes() == x.sizes(), "add_rms_norm residual: shape ", residual->sizes(),
                " differs from x's ", x.sizes());
  }
  torch::Tensor out = torch::empty({rows, hidden}, x.options());
  const float feps = static_cast<float>(eps);
  iterserve::dispatch(dtype, "add_rms_norm x", [&](auto t) {
    using T = decltype(t);
    if (weight.scalar_type() == torch::kFloat32) {
      add_rms_norm_rows<T, float>(x, residual, weight, feps, out);
    } else {
      add_rms_norm_rows<T, T>(x, residual, weight, feps, out);
    }
  });
  return {out, residual.has_value() ? *residual : x};
}

// silu(gate) * up for gate_up = [rows, 2d], gate first: [rows, d] in gate_up's dtype (float32 or
// bfloat16), computed in fp32.
torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
  check_rows(gate_up, "silu_and_mul gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_and_mul gate_up: odd last dimension ", gate_up.size(1));
  torch::Tensor out = torch::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  iterserve::dispatch(gate_up.scalar_type(), "silu_and_mul gate_up",
                      [&](auto t) { silu_and_mul_rows<decltype(t)>(gate_up, out); });
  return out;
}

// Rotates qk = [tokens, heads, head_dim] (float32 or bfloat16; any token and head strides, head_dim
// contiguous: the q and k columns of the fused qkv output) in place, token t by the cache rows at
// positions[t]. Rotate-half (NeoX) form: x * cos + rotate_half(x) * sin, cos/sin the full float32
// [max_positions, head_dim] rows; fp32 inside, rounded once to qk's dtype.
void rotary(torch::Tensor qk, const torch::Tensor& positions, const torch::Tensor& cos_cache,
            const torch::Tensor& sin_cache) {
  TORCH_CHECK(qk.device().is_cpu() && qk.dim() == 3 && qk.stride(2) == 1,
              "rotary qk: expected CPU [tokens, heads, head_dim] with contiguous head_dim");
  const int64_t tokens = qk.size(0), head_dim = qk.size(2);
  TORCH_CHECK(head_dim % 2 == 0, "rotary qk: odd head_dim ", head_dim);
  check_rows(cos_cache, "rotary cos_cache");
  check_rows(sin_cache, "rotary sin_cache");
  check_float32(cos_cache, "rotary cos_cache");
  check_float32(sin_cache, "rotary sin_cache");
  TORCH_CHECK(cos_cache.sizes() == sin_cache.sizes() && cos_cache.size(1) == head_dim,
              "rotary: cos/sin caches must both be [max_positions, ", head_dim, "]");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == tokens, "rotary positions: expected [", tokens, "]");
  torch::Tensor pos = positions.to(torch::kInt64).contiguous();
  const int64_t* pp = pos.const_data_ptr<int64_t>();
  const int64_t max_positions = cos_cache.size(0);
  for (int64_t t = 0; t < tokens; ++t)  // checked before any row is rotated: a bad step changes nothing
    TORCH_CHECK(pp[t] >= 0 && pp[t] < max_positions, "rotary positions: ", pp[t], " is outside the cache of ",
                max_positions);
  iterserve::dispatch(qk.scalar_type(), "rotary qk",
                      [&](auto t) { rotary_rows<decltype(t)>(qk, pp, cos_cache, sin_cache); });
}

// The index of each row's first maximum (NaN counted the largest), as torch's max(dim=-1).indices:
// logits = [rows, vocab] in float32 or bfloat16 with contiguous columns. Returns int64 [rows].
torch::Tensor first_max(const torch::Tensor& logits) {
  check_rows(logits, "first_max logits");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(n > 0, "first_max logits: empty rows");
  torch::Tensor out = torch::empty({rows}, logits.options().dtype(torch::kInt64));
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t rs = logits.stride(0);
  iterserve::dispatch(logits.scalar_type(), "first_max logits", [&](auto t) {
    using T = decltype(t);
    const T* base = iterserve::data<const T>(logits);
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) op[i] = first_max_index(base + i * rs, n);
    });
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  static const iterserve::c_api::LayerOps api{iterserve::c_api::kVersion, &add_rms_norm, &silu_and_mul, &rotary};
  m.attr("c_api") = iterserve::c_api::capsule_of(api);
  m.def("add_rms_norm", &add_rms_norm, "residual add + RMSNorm, float32/bfloat16 CPU", py::arg("x"), py::arg("residual"),
        py::arg("weight"), py::arg("eps"), py::call_guard<py::gil_scoped_release>());
  m.def("silu_and_mul", &silu_and_mul, "SwiGLU: silu(gate) * up, float32/bfloat16 CPU", py::arg("gate_up"),
        py::call_guard<py::gil_scoped_release>());
  m.def("rotary", &rotary, "rotate-half rotary embedding in place, float32/bfloat16 CPU", py::arg("qk"),
        py::arg("positions"), py::arg("cos_cache"), py::arg("sin_cache"), py::call_guard<py::gil_scoped_release>());
  m.def("first_max", &first_max, "index of each row's first maximum, float32/bfloat16 CPU", py::arg("logits"),
        py::call_guard<py::gil_scoped_release>());
}
