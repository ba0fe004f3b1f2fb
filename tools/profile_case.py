"""One attention call of the benchmark's shape, for a profiler to catch its kernels:
batch x seqlen = 16384 tokens, hidden 2048 (nheads = 2048 / head_dim), bf16, random inputs.

    ncu -k regex:attention_backward_sm90 --launch-count 1 ... python3 tools/profile_case.py \
        --head-dim 128 --seqlen 8192 --causal

The forward runs always (the backward needs its out and lse); the backward unless --forward-only.
--impl fa4 runs FlashAttention-4's (flash_attn.cute, where ../shared/tools/fa4_wheels.sh installed
it) instead, through autograd, for the same counters on a peer's kernels.
"""
import argparse

import torch

import flashattn_ext  # noqa: F401  (registers the ops)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--forward-only", action="store_true")
    parser.add_argument("--impl", choices=("ours", "fa4"), default="ours")
    args = parser.parse_args()
    d, n = args.head_dim, args.seqlen
    batch, nheads = max(1, 16384 // n), max(1, 2048 // d)
    q, k, v, dout = (torch.randn(batch, n, nheads, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = d ** -0.5
    if args.impl == "fa4":
        from flash_attn.cute import flash_attn_func
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = flash_attn_func(q, k, v, softmax_scale=scale, causal=args.causal)[0]
        if not args.forward_only:
            out.backward(dout)
    else:
        ops = torch.ops.flashattn_ext
        out, lse = ops.attention_forward(q, k, v, scale, args.causal, -1, -1, 0.0, None, 0.0, None, False)
        if not args.forward_only:
            ops.attention_backward(dout, q, k, v, out, lse, scale, args.causal, -1, -1, 0.0, None, 0.0, None, False)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
