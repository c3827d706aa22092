// A decode step through every layer of a Llama stack in one call: the kernels of the other CPU modules
// (c_api.h), in the order and with the arguments server/model/llama.py gives them one by one, so the
// result is the same bit for bit. Built and loaded by kernels/cpu_decode_stack.py, which says why.
//
// Per layer: h, r = add_rms_norm(x, r); qkv = linear(h); rotary on qkv's q and k columns in place;
// write_kv of its k and v columns; o = paged_decode_attention(q); x = linear(o); h, r = add_rms_norm(x, r);
// x = linear(silu_and_mul(linear(h))). After the last layer: add_rms_norm(x, r) with the final norm.

#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "c_api.h"

namespace {

using iterserve::c_api::table_of;

struct Layer {
  at::Tensor input_norm, post_norm, qkv, o, gate_up, down, cos, sin;
  std::optional<at::Tensor> qkv_bias, o_bias;
};

class DecodeStack {
 public:
  // Per layer, in order: the two norms' weights, the four projections packed by bf16_linear (their
  // biases fp32 or None), and the layer's rotary cos/sin caches (fp32 [max_positions, head_dim]).
  DecodeStack(const pybind11::object& layer_ops, const pybind11::object& linear, const pybind11::object& attention,
              const std::vector<at::Tensor>& input_norms, const std::vector<at::Tensor>& post_norms,
              const std::vector<at::Tensor>& qkv, const std::vector<std::optional<at::Tensor>>& qkv_bias,
              const std::vector<at::Tensor>& o, const std::vector<std::optional<at::Tensor>>& o_bias,
              const std::vector<at::Tensor>& gate_up, const std::vector<at::Tensor>& down,
              const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin, at::Tensor final_norm,
              double eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t hidden_size,
              int64_t intermediate_size, double scale)
      : ops_(table_of<iterserve::c_api::LayerOps>(layer_ops)),
        linear_(table_of<iterserve::c_api::Linear>(linear)),
        attention_(table_of<iterserve::c_api::Attention>(attention)),
        final_norm_(std::move(final_norm)),
        eps_(eps), num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim),
        hidden_size_(hidden_size), intermediate_size_(intermediate_size), scale_(scale) {
    const size_t n = input_norms.size();
    TORCH_CHECK(n > 0, "decode_stack: no layers");
    for (const auto* list : {&post_norms, &qkv, &o, &gate_up, &down, &cos, &sin}) {
      TORCH_CHECK(list->size() == n, "decode_stack: every per-layer list must have ", n, " entries");
    }
    TORCH_CHECK(qkv_bias.size() == n && o_bias.size() == n, "decode_stack: every per-layer list must have ", n,
                " entries");
    TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "decode_stack: num_heads must be a multiple of "
                "num_kv_heads");
    for (size_t i = 0; i < n; ++i) {
      layers_.push_back({input_norms[i], post_norms[i], qkv[i], o[i], gate_up[i], down[i], cos[i], sin[i],
                         qkv_bias[i], o_bias[i]});
    }
  }

  // x: the step's embedded tokens [n, hidden], one decode token per request, in request order; positions,
  // slot_mapping, block_tables and context_lens as the attention metadata holds them for such a step.
  // Returns the final norm's output [n, hidden]. The caches are written (the step's K/V), x is not.
  at::Tensor forward(const at::Tensor& x_in, const at::Tensor& positions, const at::Tensor& slot_mapping,
                     const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                     const std::vector<at::Tensor>& k_caches, std::vector<at::Tensor> v_caches) const {
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
                "decode_stack: one K and one V cache per layer (", layers_.size(), ")");
    TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == hidden_size_, "decode_stack: x must be [n, ", hidden_size_, "]");
    const int64_t n = x_in.size(0), q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    at::Tensor x = x_in;
    std::optional<at::Tensor> residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      at::Tensor h;
      std::tie(h, residual) = ops_.add_rms_norm(x, residual, l.input_norm, eps_);
      const at::Tensor qkv = linear_.linear(h, l.qkv, q_size + 2 * kv_size, l.qkv_bias);
      // q and k heads are rotated together, as Attention.forward does
      const at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({n, num_heads_ + num_kv_heads_, head_dim_});
      ops_.rotary(qk, positions, l.cos, l.sin);
      const at::Tensor q = qk.narrow(1, 0, num_heads_);
      const at::Tensor k = qk.narrow(1, num_heads_, num_kv_heads_);
      const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({n, num_kv_heads_, head_dim_});
      at::Tensor k_cache = k_caches[i];
      attention_.write_kv(k, v, k_cache, v_caches[i], slot_mapping);
      const at::Tensor o =
          attention_.paged_decode_attention(q, k_cache, v_caches[i], block_tables, context_lens, block_size, scale_);
      x = linear_.linear(o.view({n, q_size}), l.o, hidden_size_, l.o_bias);
      std::tie(h, residual) = ops_.add_rms_norm(x, residual, l.post_norm, eps_);
      const at::Tensor gate_up = linear_.linear(h, l.gate_up, 2 * intermediate_size_, std::nullopt);
      x = linear_.linear(ops_.silu_and_mul(gate_up), l.down, hidden_size_, std::nullopt);
    }
    return std::get<0>(ops_.add_rms_norm(x, residual, final_norm_, eps_));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  const iterserve::c_api::LayerOps& ops_;
  const iterserve::c_api::Linear& linear_;
  const iterserve::c_api::Attention& attention_;
  std::vector<Layer> layers_;
  at::Tensor final_norm_;
  double eps_;
  int64_t num_heads_, num_kv_heads_, head_dim_, hidden_size_, intermediate_size_;
  double scale_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<const pybind11::object&, const pybind11::object&, const pybind11::object&,
                          const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                          const std::vector<std::optional<at::Tensor>>&, const std::vector<at::Tensor>&,
                          const std::vector<std::optional<at::Tensor>>&, const std::vector<at::Tensor>&,
                          const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                          at::Tensor, double, int64_t, int64_t, int64_t, int64_t, int64_t, double>(),
           pybind11::arg("layer_ops"), pybind11::arg("linear"), pybind11::arg("attention"),
           pybind11::arg("input_norms"), pybind11::arg("post_norms"), pybind11::arg("qkv"), pybind11::arg("qkv_bias"),
           pybind11::arg("o"), pybind11::arg("o_bias"), pybind11::arg("gate_up"), pybind11::arg("down"),
           pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("final_norm"), pybind11::arg("eps"),
           pybind11::arg("num_heads"), pybind11::arg("num_kv_heads"), pybind11::arg("head_dim"),
           pybind11::arg("hidden_size"), pybind11::arg("intermediate_size"), pybind11::arg("scale"))
      // The GIL is released for the whole step: the engine loop runs in a thread next to the HTTP server's.
      .def("forward", &DecodeStack::forward, pybind11::arg("x"), pybind11::arg("positions"),
           pybind11::arg("slot_mapping"), pybind11::arg("block_tables"), pybind11::arg("context_lens"),
           pybind11::arg("block_size"), pybind11::arg("k_caches"), pybind11::arg("v_caches"),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def_property_readonly("num_layers", &DecodeStack::num_layers);
}
