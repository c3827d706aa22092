// Function tables the CPU kernels' extension modules export to C++ callers, as a PyCapsule named by
// each table's kName in the module's attribute `c_api`. decode_stack.cpp runs a whole decode step's
// layers through them with no Python between the kernels. Each module is still built on its own (its
// own flags, e.g. cpu_layer_ops' -ffp-contract=off, and its own kill switch); the modules of one
// checkout are built from the same csrc/, and kVersion, checked when a table is taken, guards against a
// stale build of another version.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace iterserve::c_api {

constexpr int kVersion = 1;

struct LayerOps {  // cpu_layer_ops.cpp
  static constexpr const char* kName = "iterserve.c_api.LayerOps";
  int version;
  std::tuple<at::Tensor, at::Tensor> (*add_rms_norm)(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                     const at::Tensor& weight, double eps);
  at::Tensor (*silu_and_mul)(const at::Tensor& gate_up);
  void (*rotary)(at::Tensor qk, const at::Tensor& positions, const at::Tensor& cos_cache, const at::Tensor& sin_cache);
};

struct Linear {  // bf16_linear.cpp
  static constexpr const char* kName = "iterserve.c_api.Linear";
  int version;
  at::Tensor (*linear)(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       const std::optional<at::Tensor>& bias);
};

struct Attention {  // paged_decode_attention.cpp
  static constexpr const char* kName = "iterserve.c_api.Attention";
  int version;
  at::Tensor (*paged_decode_attention)(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                       const at::Tensor& block_tables, const at::Tensor& context_lens,
                                       int64_t block_size, double scale);
  void (*write_kv)(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                   const at::Tensor& slots);
};

// The table `Table` of a module's capsule, or an error naming what does not fit.
template <typename Table>
const Table& table_of(const pybind11::object& capsule) {
  TORCH_CHECK(PyCapsule_IsValid(capsule.ptr(), Table::kName), "expected a capsule named ", Table::kName);
  const auto* t = static_cast<const Table*>(PyCapsule_GetPointer(capsule.ptr(), Table::kName));
  TORCH_CHECK(t->version == kVersion, Table::kName, " is version ", t->version, ", this build expects ", kVersion,
              ": a stale build of another checkout");
  return *t;
}

// A module's `c_api` attribute: a capsule of a table that lives as long as the module.
template <typename Table>
pybind11::capsule capsule_of(const Table& table) {
  return pybind11::capsule(static_cast<const void*>(&table), Table::kName);
}

}  // namespace iterserve::c_api
