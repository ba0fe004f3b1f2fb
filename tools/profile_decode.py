"""One decoding step (one query token, d 128, 32 query heads, bf16, random cache) by each of:
ours on the (batch, keys, kv heads, d) cache, ours on the same values stored head-major, and
cuDNN through SDPA on (batch, kv heads, keys, d), each in an NVTX range `timed_<name>` after
warm-up, for a profiler to catch their kernels:

    ncu --clock-control none --nvtx --nvtx-include "regex:timed_.*/" --metrics \
        gpu__time_duration.sum,dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,... \
        python3 tools/profile_decode.py --batch 1 --kv-len 131072 --kv-heads 32

(`lts__t_sectors_srcunit_tex_op_read.sum` x 32 bytes against the K/V bytes is how much L2
traffic a kernel's copies cost per byte read: RESULTS.md, 2026-12-07.)
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashattn_ext


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--kv-len", type=int, default=131072)
    parser.add_argument("--kv-heads", type=int, default=32)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    b, n, hkv, h, d = args.batch, args.kv_len, args.kv_heads, args.heads, args.head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    cache_seqlens = torch.full((b,), n, dtype=torch.int32, device="cuda")
    k_heads, v_heads = (t.transpose(1, 2).contiguous() for t in (k, v))  # (b, hkv, n, d)
    q_heads = q.transpose(1, 2).contiguous()
    scale = d ** -0.5

    def ours(k_cache, v_cache):
        return flashattn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                                     softmax_scale=scale)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q_heads, k_heads, v_heads, scale=scale, enable_gqa=hkv != h)

    calls = {"ours": lambda: ours(k, v),
             "ours_headmajor": lambda: ours(k_heads.transpose(1, 2), v_heads.transpose(1, 2)),
             "cudnn": cudnn}
    for _ in range(3):
        for call in calls.values():
            call()
    torch.cuda.synchronize()
    for name, call in calls.items():
        torch.cuda.nvtx.range_push(f"timed_{name}")
        call()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
