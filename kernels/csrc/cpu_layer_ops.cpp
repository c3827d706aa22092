// A Llama layer's elementwise ops on the CPU in float32, each one pass over its rows: residual add +
// RMSNorm, SwiGLU, and rotate-half rotary applied in place. Built and loaded by
// kernels/cpu_layer_ops.py, which says why they exist.
//
// Built with -ffp-contract=off: without fused multiply-adds the add and the rotary round exactly as
// torch's separate ops do, so they match the torch path bit for bit.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>

#include "vec_exp.h"

namespace {

// Elements below which a task is not worth a thread: torch's grain for elementwise ops
// (at::internal::GRAIN_SIZE). A decode step's few rows stay on the calling thread, where an OpenMP
// fork would cost more than the work.
constexpr int64_t kMinWorkPerTask = 32768;

int64_t grain(int64_t work_per_row) {
  return std::max<int64_t>(1, kMinWorkPerTask / std::max<int64_t>(1, work_per_row));
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name, ": expected a CPU float32 tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": expected [rows, cols] with contiguous columns, got ",
              t.sizes());
}

using iterserve::exp_approx;
using iterserve::kExpHi;
using iterserve::kExpLo;

}  // namespace

// residual := x + residual, out := rmsnorm(residual) * weight; without a residual, out := rmsnorm(x).
// Returns (out, the residual stream): the residual is updated in place (the layer stream owns it),
// x is only read.
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x,
                                                      const std::optional<torch::Tensor>& residual,
                                                      const torch::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm x");
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.dim() == 1 && weight.size(0) == hidden &&
                  weight.is_contiguous(), "add_rms_norm weight: expected a contiguous float32 [", hidden, "]");
  const bool has_residual = residual.has_value();
  if (has_residual) {
    check_rows(*residual, "add_rms_norm residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "add_rms_norm residual: shape ", residual->sizes(),
                " differs from x's ", x.sizes());
  }
  torch::Tensor out = torch::empty({rows, hidden}, x.options());
  const float* xp = x.const_data_ptr<float>();
  float* rp = has_residual ? residual->mutable_data_ptr<float>() : nullptr;
  const float* w = weight.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  const int64_t xs = x.stride(0), rs = has_residual ? residual->stride(0) : 0;
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(2 * hidden), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* xi = xp + i * xs;
      float* o = op + i * hidden;
      const float* src = xi;
      float ss = 0.f;
      if (has_residual) {
        float* r = rp + i * rs;
#pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < hidden; ++j) {
          const float s = xi[j] + r[j];
          r[j] = s;
          ss += s * s;
        }
        src = r;
      } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < hidden; ++j) ss += xi[j] * xi[j];
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(hidden) + feps);
#pragma omp simd
      for (int64_t j = 0; j < hidden; ++j) o[j] = src[j] * inv * w[j];
    }
  });
  return {out, has_residual ? *residual : x};
}

// silu(gate) * up for gate_up = [rows, 2d], gate first: [rows, d].
torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
  check_rows(gate_up, "silu_and_mul gate_up");
  const int64_t rows = gate_up.size(0), d = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_and_mul gate_up: odd last dimension ", gate_up.size(1));
  torch::Tensor out = torch::empty({rows, d}, gate_up.options());
  const float* gp = gate_up.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  const int64_t gs = gate_up.stride(0);
  const float lo = kExpLo, hi = kExpHi;
  at::parallel_for(0, rows, grain(2 * d), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* g = gp + i * gs;
      const float* u = g + d;
      float* o = op + i * d;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) o[j] = g[j] / (1.f + exp_approx(-g[j], lo, hi)) * u[j];
    }
  });
  return out;
}

// Rotates qk = [tokens, heads, head_dim] (any token and head strides, head_dim contiguous: the q and k
// columns of the fused qkv output) in place, token t by the cache rows at positions[t]. Rotate-half
// (NeoX) form: x * cos + rotate_half(x) * sin, cos/sin the full [max_positions, head_dim] rows.
void rotary(torch::Tensor qk, const torch::Tensor& positions, const torch::Tensor& cos_cache,
            const torch::Tensor& sin_cache) {
  TORCH_CHECK(qk.device().is_cpu() && qk.scalar_type() == torch::kFloat32 && qk.dim() == 3 && qk.stride(2) == 1,
              "rotary qk: expected CPU float32 [tokens, heads, head_dim] with contiguous head_dim");
  const int64_t tokens = qk.size(0), heads = qk.size(1), head_dim = qk.size(2), half = head_dim / 2;
  TORCH_CHECK(head_dim % 2 == 0, "rotary qk: odd head_dim ", head_dim);
  check_rows(cos_cache, "rotary cos_cache");
  check_rows(sin_cache, "rotary sin_cache");
  TORCH_CHECK(cos_cache.sizes() == sin_cache.sizes() && cos_cache.size(1) == head_dim,
              "rotary: cos/sin caches must both be [max_positions, ", head_dim, "]");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == tokens, "rotary positions: expected [", tokens, "]");
  torch::Tensor pos = positions.to(torch::kInt64).contiguous();
  const int64_t* pp = pos.const_data_ptr<int64_t>();
  const int64_t max_positions = cos_cache.size(0);
  for (int64_t t = 0; t < tokens; ++t)  // checked before any row is rotated: a bad step changes nothing
    TORCH_CHECK(pp[t] >= 0 && pp[t] < max_positions, "rotary positions: ", pp[t], " is outside the cache of ",
                max_positions);
  float* base = qk.mutable_data_ptr<float>();
  const float* cp = cos_cache.const_data_ptr<float>();
  const float* sp = sin_cache.const_data_ptr<float>();
  const int64_t ts = qk.stride(0), hs = qk.stride(1), cs = cos_cache.stride(0), ss = sin_cache.stride(0);
  at::parallel_for(0, tokens, grain(heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + pp[t] * cs;
      const float* s = sp + pp[t] * ss;
      for (int64_t h = 0; h < heads; ++h) {
        float* x = base + t * ts + h * hs;
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          const float x1 = x[j], x2 = x[j + half];
          x[j] = x1 * c[j] - x2 * s[j];
          x[j + half] = x2 * c[j + half] + x1 * s[j + half];
        }
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm, "residual add + RMSNorm, float32 CPU", py::arg("x"), py::arg("residual"),
        py::arg("weight"), py::arg("eps"), py::call_guard<py::gil_scoped_release>());
  m.def("silu_and_mul", &silu_and_mul, "SwiGLU: silu(gate) * up, float32 CPU", py::arg("gate_up"),
        py::call_guard<py::gil_scoped_release>());
  m.def("rotary", &rotary, "rotate-half rotary embedding in place, float32 CPU", py::arg("qk"),
        py::arg("positions"), py::arg("cos_cache"), py::arg("sin_cache"), py::call_guard<py::gil_scoped_release>());
}
