"""Chunked prefill: a chunk of new query rows (128..2048) against a long KV cache (32k),
causal, bottom-right aligned; TFLOP/s of flash_attn_with_kvcache next to the dense forward
(flash_attn_func) on the same q, k, v.

    python benchmarks/bench_prefill.py --out results/prefill
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

import bench_common as bc


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_common_args(p, default_out="benchmarks/results/prefill")
    bc.add_timing_args(p)
    p.add_argument("--chunks", type=int, nargs="+", default=None, help="query rows per call (128 512 2048)")
    p.add_argument("--cache-len", type=int, default=None, help="keys in the cache, the chunk's included (32768)")
    p.add_argument("--nheads", type=int, default=None)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=None)
    return p.parse_args(argv)


def apply_defaults(args, device):
    cpu = device.type == "cpu"
    args.chunks = args.chunks or ([16, 64] if cpu else [128, 512, 2048])
    args.cache_len = args.cache_len or (256 if cpu else 32768)
    args.nheads = args.nheads or (4 if cpu else 32)
    args.kv_heads = args.kv_heads or (2 if cpu else 8)
    args.head_dim = args.head_dim or (32 if cpu else 128)
    return args


def causal_flops(chunk: int, cache_len: int, nheads: int, head_dim: int) -> float:
    """4 d h per visible (query, key) pair; query i of the chunk sees cache_len - chunk + i + 1 keys."""
    pairs = chunk * (cache_len - chunk) + chunk * (chunk + 1) / 2
    return 4.0 * head_dim * nheads * pairs


def main(argv=None):
    import flashattn_ext

    args, device, dtype, out_dir, tcfg, gen, deadline = bc.start_run(parse_args(argv), apply_defaults)
    scale = 1.0 / math.sqrt(args.head_dim)
    rows = []
    for chunk in args.chunks:
        sets = bc.make_input_sets("bshd", 1, chunk, args.cache_len, args.nheads, args.kv_heads, args.head_dim,
                                  dtype, device, gen, with_dout=False)
        for s in sets:
            s.cache_seqlens = torch.full((1,), args.cache_len, dtype=torch.int32, device=device)
        flops = causal_flops(chunk, args.cache_len, args.nheads, args.head_dim)
        runs = {
            "ours_kvcache": lambda s: flashattn_ext.flash_attn_with_kvcache(
                s.q, s.k, s.v, cache_seqlens=s.cache_seqlens, softmax_scale=scale, causal=True),
            "ours_dense": lambda s: flashattn_ext.flash_attn_func(s.q, s.k, s.v, softmax_scale=scale, causal=True),
        }
        with torch.no_grad():
            expected = runs["ours_dense"](sets[0]).float()
            got = runs["ours_kvcache"](sets[0]).float()
            diff = (got - expected).abs().max().item()
            line = dict(chunk=chunk, cache_len=args.cache_len, nheads=args.nheads, kv_heads=args.kv_heads,
                        head_dim=args.head_dim, max_abs_diff_kvcache_vs_dense=diff)
            for name, fn in runs.items():
                timing = bc.measure(fn, sets, device, tcfg)
                line[f"{name} TFLOP/s"] = flops / (timing.median_ms * 1e-3) / 1e12
        line["kvcache / dense"] = line["ours_kvcache TFLOP/s"] / line["ours_dense TFLOP/s"]
        rows.append(line)
        print(line, flush=True)
    print(bc.format_table(rows, title=f"\nChunked prefill, causal, cache {args.cache_len}, d={args.head_dim}, "
                          f"{args.nheads} query / {args.kv_heads} KV heads"))
    bc.write_csv(rows, out_dir / "prefill.csv")
    bc.write_json(bc.result_document("prefill", args, device, rows, complete=True), out_dir / "prefill.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
