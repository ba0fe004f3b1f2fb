"""Reference attention and the error rule the kernels are held to.

The reference is written from the definition, independently of the library:
it materialises the full score matrix, builds the mask from an explicit index
comparison, and uses torch.softmax / torch.logsumexp. It shares no code with
flashattn_ext (not even its mask helpers), so a bug in one is not silently
copied into the other.

Error rule (as flash-attn's tests), on max absolute errors against the fp64
reference, with FACTOR = 2 for out and lse and 3 for dq, dk, dv:

* bf16/fp16: kernel error <= FACTOR x the error of this same reference run
  entirely in the low precision, + ABS_FLOOR = 1e-5 (for tensors whose
  low-precision error is 0, e.g. one key: out = v exactly). Gradients add
  flash-attn's rounding term instead where it is larger (as its
  hopper/test_flash_attn.py does): 2 x max |(r + 0.3) - 0.3 - r| with r the
  reference in the low precision, about one rounding step of the output dtype
  at the gradients' size. A FlashAttention backward starts from the rounded
  output (D = rowsum(dout * out)), which the PyTorch baseline never forms:
  - one key: dk = 0 exactly, which the baseline's p * (dp - sum(dp * p)) with
    p = 1 cancels exactly, while D against dP = dout v^T summed in another
    order in fp32 leaves rounding noise of a few fp32 ulps of the other
    gradients (2e-5 at sq 239, one key, d 256): gradients get at least
    2^-20 x scale (8 fp32 ulps) too;
  - tiny problems (sq 17, sk 2): the baseline can be luckier by an ulp;
    measured over 40 seeds, our two kernels and the baseline have mean dq
    errors within 6 % of one another (benchmarks/RESULTS.md).
* fp32: kernel error <= max(1e-4 x scale, FACTOR x the fp32 PyTorch error) + 1e-6.
* fp64: kernel error <= 1e-10 x scale + 1e-12 (lse included: it is fp64 for
  fp64 inputs).

The sink's gradient (dsink) is held to the gradients' rule with its own scale; it is
fp32 (the sink's dtype) for every input dtype, so fp64 inputs hold it to the fp32 bound.

The backward's D term (backward_d_allowances, where a test passes it): a FlashAttention
backward forms dS = P (dP - D) with D = rowsum(dout * out) from the output it wrote,
rounded, where exact arithmetic has D = rowsum(dP * P). Both the rounding of out and the
fp32 rounding of the two sums that cancel (each of the size of sum |dout * out|, which can
be far larger than any gradient: one visible key per row at d 192 leaves dq = 0 exactly
and 2.5e-5 of noise in fp16) reach dq, dk and dsink as -P times the row's error of D. That
is no error of the kernel, and the baseline never forms D: an error up to the propagated
bound, element by element, is subtracted before the rule applies. The bound takes the
output's error as measured (the output's own check bounds it) and 8 ulps of the compute
precision of sum |dout * out| per row, and grows by one ulp of the dtype (the gradient that
carries it is rounded too: where the exact gradient is 0, that rounding is all the error
the baseline's rule would see).

scale is max |reference| of the tensor for out and lse, and the largest of
max |dq|, |dk|, |dv| for the gradients: a gradient that is ~0 in exact
arithmetic (one visible key: dk = 0) is left with rounding noise of the size of
the terms that cancel in it, which the other gradients measure.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple

import torch

FORWARD_FACTOR = 2.0
BACKWARD_FACTOR = 3.0
ABS_FLOOR = 1e-5
FP32_NOISE_RTOL = 2.0 ** -20  # 8 fp32 ulps, relative to the gradients' scale
FP64_NOISE_RTOL = 2.0 ** -49  # 8 fp64 ulps
FP32_RTOL, FP32_ATOL = 1e-4, 1e-6
FP64_RTOL, FP64_ATOL = 1e-10, 1e-12
LOW_PRECISION = (torch.float16, torch.bfloat16)
# dtypes whose tolerance uses the same-precision PyTorch baseline.
BASELINE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GRADIENTS = ("dq", "dk", "dv")
# The sink's gradient sums over every row of its head: its own scale, the gradients' floors.
SINK_GRADIENT = "dsink"


def visibility_mask(seqlen_q: int, seqlen_k: int, causal: bool, window: Tuple[int, int],
                    device=None) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool: query i sees key j iff
    i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right,
    a negative bound meaning unbounded, and causal meaning right = 0."""
    left, right = window
    if causal:
        right = 0
    i = torch.arange(seqlen_q, device=device).view(-1, 1)
    j = torch.arange(seqlen_k, device=device).view(1, -1)
    diagonal = i + seqlen_k - seqlen_q
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        visible &= j >= diagonal - left
    if right >= 0:
        visible &= j <= diagonal + right
    return visible


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        softmax_scale: Optional[float] = None, causal: bool = False,
                        window: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                        alibi_slopes: Optional[torch.Tensor] = None,
                        learnable_sink: Optional[torch.Tensor] = None,
                        dropout_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                        compute_dtype: torch.dtype = torch.float64):
    """(out, lse) of attention on (batch, seqlen, nheads, head_dim) inputs, computed
    in ``compute_dtype`` (fp64 for the reference; the inputs' own dtype for the
    low-precision PyTorch baseline). Differentiable with respect to q, k, v and
    learnable_sink.

    learnable_sink (nheads,): a logit per head appended to every row's scores; it joins
    the softmax (and lse) and contributes no value. dropout_mask (batch, nheads,
    seqlen_q, seqlen_k) bool: the kept probabilities, scaled by 1 / (1 - dropout_p)
    before P V; lse is that of the undropped ones.

    out has q's shape and compute_dtype; lse is (batch, nheads, seqlen_q) in
    compute_dtype, +inf for rows that see no key and no sink (whose out is 0)."""
    probs, scores, row_sees_a_key, v = _softmax_probabilities(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window=window, softcap=softcap,
        alibi_slopes=alibi_slopes, learnable_sink=learnable_sink, compute_dtype=compute_dtype)
    if dropout_mask is not None:
        probs = probs * dropout_mask / (1.0 - dropout_p)
    out = torch.einsum("bhij,bjhd->bihd", probs, v)
    lse = torch.logsumexp(scores, dim=-1).masked_fill(~row_sees_a_key, float("inf"))
    return out, lse


def _softmax_probabilities(q, k, v, *, softmax_scale, causal, window, softcap, alibi_slopes, learnable_sink,
                           compute_dtype):
    """attention_reference's probabilities (batch, nheads, seqlen_q, seqlen_k) before dropout,
    its scores (with the sink's column), which rows see a key, and v as the heads of q."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    q, k, v = (t.to(compute_dtype) for t in (q, k, v))
    if nheads_kv != nheads:
        # MQA/GQA: query head h reads kv head h // (nheads // nheads_kv).
        k = k.repeat_interleave(nheads // nheads_kv, dim=2)
        v = v.repeat_interleave(nheads // nheads_kv, dim=2)

    scores = torch.einsum("bihd,bjhd->bhij", q * softmax_scale, k)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(compute_dtype)
        slopes = slopes.view(1, nheads) if slopes.dim() == 1 else slopes
        i = torch.arange(seqlen_q, device=q.device).view(-1, 1)
        j = torch.arange(seqlen_k, device=q.device).view(1, -1)
        distance = (i + seqlen_k - seqlen_q - j).abs().to(compute_dtype)
        scores = scores - slopes[:, :, None, None] * distance

    visible = visibility_mask(seqlen_q, seqlen_k, causal, window, device=q.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    if learnable_sink is not None:
        sink = learnable_sink.to(compute_dtype).view(1, nheads, 1, 1)
        scores = torch.cat([scores, sink.expand(batch, nheads, seqlen_q, 1)], dim=-1)
        visible = torch.cat([visible, visible.new_ones(seqlen_q, 1)], dim=-1)
    row_sees_a_key = visible.any(dim=-1)  # (seqlen_q,)
    # Rows that see nothing: score 0 everywhere, so softmax and logsumexp stay
    # finite (no NaN in the gradient); their probabilities are zeroed below.
    scores = scores.masked_fill(~row_sees_a_key.view(-1, 1), 0.0)
    probs = (torch.softmax(scores, dim=-1) * visible)[..., :seqlen_k]
    return probs, scores, row_sees_a_key, v


def probabilities_reference(q, k, *, softmax_scale=None, causal=False, window=(-1, -1), softcap=0.0,
                            alibi_slopes=None, learnable_sink=None, compute_dtype=torch.float64):
    """The attention probabilities exp(S - lse) (batch, nheads, seqlen_q, seqlen_k) before
    dropout, as attention_reference forms them, in compute_dtype."""
    return _softmax_probabilities(q, k, k, softmax_scale=softmax_scale, causal=causal, window=window,
                                  softcap=softcap, alibi_slopes=alibi_slopes, learnable_sink=learnable_sink,
                                  compute_dtype=compute_dtype)[0]


def attention_reference_with_grads(q, k, v, dout, **kwargs):
    """(out, lse, dq, dk, dv) of attention_reference, gradients of <out, dout> by autograd;
    (out, lse, dq, dk, dv, dsink) with a learnable_sink (dsink in fp32, the sink's dtype,
    from the gradient in compute_dtype)."""
    compute_dtype = kwargs.get("compute_dtype", torch.float64)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    sink = kwargs.pop("learnable_sink", None)
    if sink is not None:
        # A leaf in compute_dtype, so that the low-precision baseline rounds it as it does q.
        leaves.append(sink.detach().to(compute_dtype).requires_grad_(True))
        kwargs["learnable_sink"] = leaves[-1]
    out, lse = attention_reference(*leaves[:3], **kwargs)
    grads = torch.autograd.grad(out, leaves, dout.to(compute_dtype), allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]
    return (out.detach(), lse.detach(), *grads)


def backward_d_allowances(q, k, v, dout, out, *, softmax_scale=None, dropout_mask=None, dropout_p: float = 0.0,
                          **kwargs) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(dq, dk, dsink) fp64 bounds, element by element, of what the backward's D =
    rowsum(dout * out) adds to each gradient when formed from `out` (the kernel's output, in
    the case's layout) instead of the exact output (see the module docstring): per row,
    delta = |rowsum(dout * (out - exact))| + 8 ulps x rowsum(|dout * exact|) (ulps of fp64 for
    an fp64 out, of fp32, the kernels' accumulators, for any other), and
    dq_i = scale delta_i sum_j P_ij |k_j|, dk_j = scale sum_i P_ij delta_i |q_i| (summed over
    a KV head's query heads), dsink = sum_i P_sink,i delta_i (None without a sink), P the
    undropped probabilities (dS takes them with dropout too). kwargs: attention_reference's
    mask and modifiers."""
    batch, seqlen_q, nheads, head_dim = q.shape
    nheads_kv = k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    noise_rtol = FP64_NOISE_RTOL if out.dtype == torch.float64 else FP32_NOISE_RTOL
    q, k, v, dout, out = (t.detach().double() for t in (q, k, v, dout, out))
    probs, scores, _, _ = _softmax_probabilities(q, k, v, softmax_scale=scale, compute_dtype=torch.float64,
                                                 **kwargs)
    exact, lse = attention_reference(q, k, v, softmax_scale=scale, compute_dtype=torch.float64,
                                     dropout_mask=dropout_mask, dropout_p=dropout_p, **kwargs)
    delta = ((dout * (out - exact)).sum(-1).abs() + noise_rtol * (dout * exact).abs().sum(-1)).transpose(1, 2)
    group = nheads // nheads_kv
    dq = scale * torch.einsum("bhij,bhi,bjhd->bihd", probs, delta, k.abs().repeat_interleave(group, dim=2))
    dk = scale * torch.einsum("bhij,bhi,bihd->bjhd", probs, delta, q.abs())
    dk = dk.view(batch, -1, nheads_kv, group, head_dim).sum(3)
    dsink = None
    if kwargs.get("learnable_sink") is not None:
        # The sink's probability per row, exp(sink - lse); rows of lse +inf have none.
        sink_probs = torch.exp(scores[..., -1] - lse)
        dsink = (sink_probs * delta).sum((0, 2))
    return dq, dk, dsink


def max_abs_error(actual: torch.Tensor, expected: torch.Tensor, allowance: Optional[torch.Tensor] = None) -> float:
    """max |actual - expected| in fp64, less `allowance` element by element where given (never
    below 0); +inf entries must coincide and count as 0."""
    actual, expected = actual.double(), expected.double()
    infinite = torch.isinf(expected)
    if not torch.equal(torch.isinf(actual), infinite) or not torch.equal(actual[infinite], expected[infinite]):
        return math.inf
    if actual.numel() == 0:
        return 0.0
    error = (actual - expected).masked_fill(infinite, 0.0).abs()
    if allowance is not None:
        error = (error - allowance.double()).clamp(min=0.0)
    return error.max().item()


def magnitude(t: torch.Tensor) -> float:
    """max |t| over its finite entries (0 for none)."""
    finite = t[torch.isfinite(t)].double()
    return finite.abs().max().item() if finite.numel() else 0.0


def output_rounding(reference: torch.Tensor, dtype: torch.dtype) -> float:
    """flash-attn's atol: 2 x max |(r + 0.3) - 0.3 - r| with r = reference in dtype."""
    finite = reference[torch.isfinite(reference)]
    if finite.numel() == 0:
        return 0.0
    r = finite.to(dtype)
    return 2.0 * ((r + 0.3) - 0.3 - r).abs().max().item()


def tolerance(name: str, dtype: torch.dtype, reference: torch.Tensor,
              low_precision: Optional[torch.Tensor], scale: Optional[float] = None) -> float:
    """The largest max-abs error the error rule allows for one output tensor;
    ``scale`` (default: max |reference|) is what the fp32/fp64 relative bounds
    are relative to."""
    if scale is None:
        scale = magnitude(reference)
    if dtype in LOW_PRECISION:
        assert low_precision is not None, "the low-precision baseline is needed for bf16/fp16"
        factor = FORWARD_FACTOR if name in ("out", "lse") else BACKWARD_FACTOR
        floor = ABS_FLOOR
        if name in GRADIENTS + (SINK_GRADIENT,):
            floor = max(floor, FP32_NOISE_RTOL * scale, output_rounding(reference, dtype))
        return factor * max_abs_error(low_precision, reference) + floor
    if dtype == torch.float32:
        # Where the exact result is ~0 (one visible key: dk = 0) the fp32
        # rounding of the cancelling terms sets the error, not the result's
        # scale; the fp32 PyTorch baseline measures that noise.
        factor = FORWARD_FACTOR if name in ("out", "lse") else BACKWARD_FACTOR
        baseline = factor * max_abs_error(low_precision, reference) if low_precision is not None else 0.0
        return max(FP32_RTOL * scale, baseline) + FP32_ATOL
    if dtype == torch.float64:
        if name == SINK_GRADIENT:  # fp32 (the sink's dtype) whatever the inputs' dtype
            return FP32_RTOL * scale + FP32_ATOL
        return FP64_RTOL * scale + FP64_ATOL
    raise ValueError(f"no tolerance for {dtype}")


def assert_error_rule(names: Sequence[str], actual: Sequence[torch.Tensor],
                      reference: Sequence[torch.Tensor],
                      low_precision: Optional[Sequence[Optional[torch.Tensor]]], dtype: torch.dtype,
                      context: str = "", allowances: Optional[Dict[str, torch.Tensor]] = None) -> None:
    """allowances: per-name element-wise bounds of error that is no kernel's
    (backward_d_allowances), taken off before the rule."""
    allowances = allowances or {}
    failures = []
    # dq, dk, dv are relative to the largest of them: where one is ~0 in exact
    # arithmetic (one visible key: dk = 0), the kernel's D = rowsum(dout * out)
    # leaves rounding noise of the size of the others' terms.
    gradient_scale = max([magnitude(r) for n, r in zip(names, reference) if n in GRADIENTS], default=None)
    for index, name in enumerate(names):
        a, r = actual[index], reference[index]
        assert a.shape == r.shape, f"{context} {name}: shape {list(a.shape)} != reference {list(r.shape)}"
        lp = low_precision[index] if low_precision is not None else None
        allowance = allowances.get(name)
        if allowance is not None:
            allowance = allowance * (1.0 + torch.finfo(dtype).eps)
        error = max_abs_error(a, r, allowance)
        allowed = tolerance(name, dtype, r, lp, gradient_scale if name in GRADIENTS else None)
        if not error <= allowed:
            baseline = f", low-precision PyTorch error {max_abs_error(lp, r):.3g}" if lp is not None else ""
            failures.append(f"{name}: max |err| {error:.3g} > allowed {allowed:.3g}{baseline}")
    assert not failures, f"{context} ({dtype}): " + "; ".join(failures)


def assert_s_dmask(s_dmask, q, k, keep_mask=None, *, rtol, atol, **kwargs):
    """s_dmask is flash-attn's S_dmask of a call on q, k (return_attn_probs=True): (batch,
    nheads, seqlen_q, seqlen_k rounded up to multiples of 128) in q's dtype, zero in the
    padding, |s_dmask| the probabilities of probabilities_reference(q, k, **kwargs) and
    negative exactly where keep_mask (bool, (batch, nheads, seqlen_q, seqlen_k); None: no
    dropout) drops a nonzero probability."""
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k = k.shape[1]
    rounded = lambda n: (n + 127) // 128 * 128  # noqa: E731
    assert s_dmask.shape == (batch, nheads, rounded(seqlen_q), rounded(seqlen_k)), s_dmask.shape
    assert s_dmask.dtype == q.dtype and s_dmask.device == q.device
    s_dmask = s_dmask.detach().cpu().double()
    assert not s_dmask[:, :, seqlen_q:].any() and not s_dmask[:, :, :, seqlen_k:].any(), "nonzero padding"
    probs = s_dmask[:, :, :seqlen_q, :seqlen_k]
    kwargs = {name: value.detach().cpu() if isinstance(value, torch.Tensor) else value
              for name, value in kwargs.items()}
    expected = probabilities_reference(q.detach().cpu(), k.detach().cpu(), **kwargs)
    torch.testing.assert_close(probs.abs(), expected, rtol=rtol, atol=atol)
    dropped = torch.zeros_like(expected, dtype=torch.bool) if keep_mask is None else ~keep_mask.cpu()
    nonzero = probs != 0
    assert torch.equal((probs < 0) & nonzero, dropped & nonzero), "S_dmask's signs are not the dropout mask"
