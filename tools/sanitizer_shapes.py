"""A handful of odd shapes through the CUDA forward and backward, for
compute-sanitizer (memcheck finds out-of-bounds and misaligned accesses,
racecheck shared-memory races). Run with the caching allocator off, which would
otherwise hide out-of-bounds accesses inside its pooled blocks:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python3 tools/sanitizer_shapes.py

FLASHATTN_DISABLE_HOPPER_KERNELS=1 runs the sm80 kernels instead of the Hopper ones.
"""
import torch

import flashattn_ext

# (batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim, causal, window, deterministic)
SHAPES = (
    (1, 1, 239, 2, 1, 40, False, (-1, -1), False),
    (1, 239, 1, 2, 2, 128, False, (-1, -1), False),
    (2, 113, 203, 4, 2, 64, True, (-1, -1), False),
    (2, 300, 413, 4, 2, 64, True, (-1, -1), True),
    (1, 413, 300, 2, 1, 128, False, (-1, -1), True),
    (1, 203, 113, 2, 2, 256, True, (-1, -1), False),
    (2, 300, 211, 4, 2, 256, False, (-1, -1), True),
    (1, 211, 300, 2, 1, 256, True, (-1, -1), True),
    (1, 129, 300, 8, 1, 96, False, (32, 8), False),
    (1, 129, 500, 2, 2, 128, False, (100, 20), True),
    (1, 17, 17, 2, 2, 192, True, (-1, -1), False),
)


def main():
    for batch, sq, sk, hq, hk, d, causal, window, deterministic in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(sq * 1000 + sk + d)
        make = lambda s, h: torch.randn(batch, s, h, d, device="cuda", dtype=torch.bfloat16,  # noqa: E731
                                        generator=gen, requires_grad=True)
        q, k, v = make(sq, hq), make(sk, hk), make(sk, hk)
        out = flashattn_ext.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                            deterministic=deterministic)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        finite = all(bool(t.isfinite().all()) for t in (out, q.grad, k.grad, v.grad))
        print(f"b={batch} sq={sq} sk={sk} hq={hq} hk={hk} d={d} causal={causal} window={window}: "
              f"{'finite' if finite else 'NON-FINITE'}")


if __name__ == "__main__":
    main()
