"""Decoding at fixed split counts beside the split model's own choice and cuDNN: how far the
model's choice (num_splits=0) is from the best fixed `num_splits`, per shape.

One query token, 32 query heads, bf16, a random contiguous (batch, keys, KV heads, d) cache;
each call timed as replays of a CUDA graph (bench_common.measure_graph_replays), GB/s of K/V
read. cuDNN (bench_common's sdpa_cudnn peer) runs on the same values stored head-major. One
line per shape:

    python3 tools/sweep_decode_splits.py --head-dims 128 64 > splits.txt

(RESULTS.md, 2026-12-07: the split model's saturation point was refitted from this.)
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_common as bc  # noqa: E402

import flashattn_ext  # noqa: E402

QUERY_HEADS = 32


def gbps(kv_bytes, fn, device, cfg):
    return kv_bytes / (bc.measure_graph_replays(fn, [None], device, cfg).median_ms * 1e-3) / 1e9


def sweep_shape(d, hkv, batch, keys, splits, device, cfg, gen):
    q = torch.randn(batch, 1, QUERY_HEADS, d, device=device, dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(batch, keys, hkv, d, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    seqlens = torch.full((batch,), keys, dtype=torch.int32, device=device)
    kv_bytes = 2 * k.numel() * k.element_size()
    scale = d ** -0.5
    ours = {s: gbps(kv_bytes, lambda _, s=s: flashattn_ext.flash_attn_with_kvcache(
        q, k, v, cache_seqlens=seqlens, softmax_scale=scale, num_splits=s), device, cfg) for s in [0] + splits}
    q_h, k_h, v_h = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    del k, v
    (cudnn,) = bc.build_impls(["sdpa_cudnn"])
    with torch.no_grad(), cudnn.context():
        return ours, gbps(kv_bytes, lambda _: cudnn.forward(q_h, k_h, v_h, False, scale), device, cfg)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", type=int, nargs="+", default=[128])
    p.add_argument("--kv-heads", type=int, nargs="+", default=[32, 8])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--kv-lens", type=int, nargs="+", default=[4096, 32768, 131072])
    p.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 6, 8, 12, 16, 24, 32, 47, 64, 96, 128])
    p.add_argument("--max-gib", type=float, default=48.0,
                   help="shapes whose K / V and their head-major copy would take more are skipped")
    args = p.parse_args()
    device = torch.device("cuda")
    cfg = bc.TimingConfig()
    gen = torch.Generator(device=device).manual_seed(0)
    for d in args.head_dims:
        for hkv in args.kv_heads:
            for batch in args.batches:
                for keys in args.kv_lens:
                    if 4 * batch * keys * hkv * d * 2 > args.max_gib * 2 ** 30:
                        print(f"d{d} hkv{hkv:2} b{batch} n{keys:6}  skipped (memory)", flush=True)
                        continue
                    ours, cudnn = sweep_shape(d, hkv, batch, keys, args.splits, device, cfg, gen)
                    best = max(args.splits, key=lambda s: ours[s])
                    print(f"d{d} hkv{hkv:2} b{batch} n{keys:6}  auto {ours[0]:5.0f}  best {ours[best]:5.0f}@{best:3}  "
                          f"cudnn {cudnn:5.0f}  auto/c {ours[0] / cudnn:.3f} best/c {ours[best] / cudnn:.3f}  | "
                          + " ".join(f"{s}:{ours[s]:.0f}" for s in args.splits), flush=True)
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
