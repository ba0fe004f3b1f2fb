"""The dq error of both CUDA kernel families, and of the low-precision PyTorch
baseline, over 40 seeds at one tiny shape (seqlen_q 17, seqlen_k 2, causal, GQA
2:1, d 256 and 128, fp16 and bf16), against the fp64 reference of tests/.

A diagnostic, not a test: on such shapes the 3 x baseline bound of the error rule
is decided by single-ulp luck (tests/reference.py explains the rounding term the
rule adds for it); this prints how often each family would miss the bare bound
and the mean errors, so that a kernel that is really less accurate would show.

    python3 tools/backward_error_seeds.py      (needs a CUDA build and a GPU)
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from cuda_inputs import random_inputs  # noqa: E402
from reference import attention_reference_with_grads, max_abs_error  # noqa: E402

import flashattn_ext  # noqa: E402

SEEDS = 40


def dq_error(q, k, v, dout, reference, hopper: bool) -> float:
    # Read per call by the extension (cuda_backend.cpp: device_limits()).
    os.environ["FLASHATTN_DISABLE_HOPPER_KERNELS"] = "" if hopper else "1"
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    flashattn_ext.flash_attn_func(q, k, v, causal=True).backward(dout)
    return max_abs_error(q.grad, reference)


def main():
    for d in (256, 128):
        for dtype in (torch.float16, torch.bfloat16):
            rows = []
            for seed in range(SEEDS):
                q, k, v, dout = random_inputs(2, 17, 2, 2, 1, d, dtype, seed=seed)
                kwargs = dict(softmax_scale=d ** -0.5, causal=True, window=(-1, -1))
                reference = attention_reference_with_grads(q, k, v, dout, **kwargs)[2]
                baseline = attention_reference_with_grads(q, k, v, dout, compute_dtype=dtype, **kwargs)[2]
                rows.append((dq_error(q, k, v, dout, reference, True), dq_error(q, k, v, dout, reference, False),
                             max_abs_error(baseline, reference)))
            misses = [sum(r[i] > 3 * r[2] + 1e-5 for r in rows) for i in (0, 1)]
            means = [sum(r[i] for r in rows) / SEEDS for i in (0, 1, 2)]
            print(f"d={d} {dtype}: over {SEEDS} seeds, bare 3 x baseline bound missed by sm90 {misses[0]}, "
                  f"sm80 {misses[1]}; mean dq error sm90 {means[0]:.3g}, sm80 {means[1]:.3g}, "
                  f"baseline {means[2]:.3g}")


if __name__ == "__main__":
    main()
