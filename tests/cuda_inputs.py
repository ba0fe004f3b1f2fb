"""Inputs and conditions shared by the GPU tests (test_forward_cuda.py, test_backward_cuda.py,
the scheduler and tile-plan tests)."""

from __future__ import annotations

import torch

import flashattn_ext

LOW_PRECISION = (torch.bfloat16, torch.float16)


def hopper_build() -> bool:
    """An sm_90 GPU and a build with the Hopper kernels: where the wgmma / TMA kernels run."""
    return (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
            and flashattn_ext.build_info().get("hopper_kernels") == "yes")


def poison_allocator(device="cuda", nbytes=1 << 28):
    """Fills a large block of the caching allocator with NaN and frees it, so the op's
    outputs, gradients and fp32 workspaces (allocated next, with at::empty) start as
    NaN, not as zeros: an element the kernels never write shows up."""
    torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(float("nan"))


def random_inputs(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, dtype, layout="contiguous",
                  seed=0):
    """q, k, v, dout on the GPU; layout "mixed" gives each tensor a different
    non-contiguous layout, so reading one tensor with another's strides fails."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)

    if layout == "contiguous":
        return (randn(batch, seqlen_q, nheads, head_dim), randn(batch, seqlen_k, nheads_kv, head_dim),
                randn(batch, seqlen_k, nheads_kv, head_dim), randn(batch, seqlen_q, nheads, head_dim))
    q = randn(batch, seqlen_q, 3, nheads, head_dim)[:, :, 0]           # a slice of packed qkv
    k = randn(batch, nheads_kv, seqlen_k, head_dim).transpose(1, 2)     # head-major
    v = randn(seqlen_k, nheads_kv, batch, head_dim).permute(2, 0, 1, 3)  # seqlen-major
    dout = randn(batch, nheads, seqlen_q, 2 * head_dim)[..., head_dim:].transpose(1, 2)
    return q, k, v, dout
