// Operator schemas of flashattn_ext. Each backend file registers its kernels for
// these with TORCH_LIBRARY_IMPL; the Python package adds fake (meta) kernels and
// autograd in flashattn_ext/ops.py.
//
// The schemas carry every feature planned (window, softcap, ALiBi, dropout,
// deterministic backward), so adding a kernel feature never changes them: a
// backend that lacks a feature refuses it with NotImplementedError.
#include <torch/library.h>

TORCH_LIBRARY(flashattn_ext, m) {
  // q: (batch, seqlen_q, nheads, head_dim); k, v: (batch, seqlen_k, nheads_kv, head_dim).
  // Returns out like q and lse (batch, nheads, seqlen_q) fp32, natural log; a row
  // that sees no key gets out = 0 and lse = +inf. `deterministic` does not change the
  // forward: it is the choice of backward, carried by the op so that its autograd
  // formula (flashattn_ext/ops.py) needs no state of its own.
  m.def(
      "attention_forward(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, "
      "int window_left, int window_right, float softcap, Tensor? alibi_slopes, "
      "float dropout_p, Tensor? rng_state, bool deterministic=False) -> (Tensor out, Tensor lse)");
  // Recomputes the attention blocks from q, k and the saved lse; never stores P.
  m.def(
      "attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "float softmax_scale, bool causal, int window_left, int window_right, float softcap, "
      "Tensor? alibi_slopes, float dropout_p, Tensor? rng_state, bool deterministic) "
      "-> (Tensor dq, Tensor dk, Tensor dv)");
}
