// The pybind11 module flashattn_ext._C. Importing it loads the library, which
// registers the ops (torch.ops.flashattn_ext.*); the functions here call the
// same ops through the dispatcher, so they reach the same kernels.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>

#include "attention_api.h"
#include "attention_ops.h"
#include "build_info.h"

namespace {

std::tuple<at::Tensor, at::Tensor> attention_forward(FLASHATTN_FORWARD_ARGS) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("flashattn_ext::attention_forward", "")
                       .typed<decltype(flashattn::attention_forward_cpu)>();
  return op.call(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                 dropout_p, rng_state, deterministic, FLASHATTN_SEQUENCE_ARG_NAMES, learnable_sink);
}

flashattn::BackwardGradients attention_backward(FLASHATTN_BACKWARD_ARGS) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("flashattn_ext::attention_backward", "")
                       .typed<decltype(flashattn::attention_backward_cpu)>();
  return op.call(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right,
                 softcap, alibi_slopes, dropout_p, rng_state, deterministic, FLASHATTN_SEQUENCE_ARG_NAMES,
                 learnable_sink);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "flashattn_ext: IO-aware exact attention (FlashAttention) kernels";
  m.def("attention_forward", &attention_forward, "Forward: returns (out, lse)");
  m.def("attention_backward", &attention_backward, "Backward: returns (dq, dk, dv, dsink)");
  // The op's head-dim limits, for the Python API's padding (flashattn_ext/checks.py).
  m.attr("MAX_HEAD_DIM") = flashattn::kMaxHeadDim;
  m.attr("HEAD_DIM_ALIGNMENT") = flashattn::kHeadDimAlignment;
  m.def("build_info", []() {
    pybind11::dict info;
    for (const auto& [key, value] : flashattn::build_info()) info[key.c_str()] = value;
    return info;
  }, "What this binary was built from and for");
}
