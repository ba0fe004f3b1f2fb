"""Recomputation against activation checkpointing: time and memory of one attention
forward + backward for

  (a) standard attention storing its activations (the N x N probabilities),
  (b) the same under torch.utils.checkpoint: nothing stored, the whole forward run again
      in the backward (the ordinary memory-for-time trade),
  (c) ours, which stores only out and the log-sum-exp and recomputes the attention
      blocks on chip in its backward.

The claim measured: (c) has the memory of (b) or less, and is faster than (a), so its
recomputation is close to free, while (b) pays for its memory in step time.

    python benchmarks/bench_recompute.py --quick --out results/recompute
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.utils.checkpoint

import bench_common as bc


def checkpointed_materialized_attention(q, k, v, causal, scale):
    return torch.utils.checkpoint.checkpoint(bc.materialized_attention, q, k, v, causal, scale,
                                             use_reentrant=False)


VARIANTS = [
    # (row name, implementation in the registry, forward override or None)
    ("standard (stores P)", "materialized", None),
    ("standard + checkpoint", "materialized", checkpointed_materialized_attention),
    ("ours (recomputes)", "ours", None),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_common_args(p, default_out="benchmarks/results/recompute")
    bc.add_timing_args(p)
    p.add_argument("--seqlens", type=int, nargs="+", default=None)
    p.add_argument("--tokens", type=int, default=None, help="batch * seqlen (16384)")
    p.add_argument("--hidden", type=int, default=None, help="nheads * headdim (2048)")
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--causal", action="store_true")
    return p.parse_args(argv)


def apply_defaults(args, device):
    cpu = device.type == "cpu"
    args.tokens = args.tokens or (256 if cpu else 16384)
    args.hidden = args.hidden or (64 if cpu else 2048)
    args.head_dim = args.head_dim or (32 if cpu else 64)
    if args.seqlens is None:
        args.seqlens = [64, 128] if cpu else ([2048, 4096, 8192] if args.quick else
                                              [1024, 2048, 4096, 8192, 16384])
    return args


def main(argv=None):
    args, device, dtype, out_dir, tcfg, gen, deadline = bc.start_run(parse_args(argv), apply_defaults)
    impls = {impl.name: impl for impl in bc.build_impls(["materialized", "ours"])}
    scale = 1.0 / math.sqrt(args.head_dim)
    nheads = args.hidden // args.head_dim
    rows = []

    points = [(n, v) for n in args.seqlens for v in VARIANTS]
    for n, (variant, impl_name, override) in bc.progress(points, desc="recompute points"):
        impl = impls[impl_name]
        forward = override or impl.forward
        batch = args.tokens // n
        row = dict(dtype=args.dtype, seqlen=n, batch=batch, nheads=nheads, head_dim=args.head_dim,
                   causal=args.causal, variant=variant, impl=impl_name, status=bc.STATUS_OK,
                   reason="", fwd_bwd_ms=None, peak_bytes=None, saved_activation_bytes=None)
        if deadline.expired():
            row.update(status=bc.STATUS_SKIPPED, reason="time limit")
            rows.append(row)
            continue
        try:
            sets = bc.make_input_sets(impl.layout, batch, n, n, nheads, nheads, args.head_dim,
                                      dtype, device, gen, requires_grad=True)
            mem = bc.fwd_bwd_memory(impl, vars(sets[0]), args.causal, scale, device, forward=forward)
            row.update(peak_bytes=mem["peak_bytes"], saved_activation_bytes=mem["saved_activation_bytes"])
            with impl.context():
                timing = bc.measure(lambda s: torch.autograd.grad(
                    forward(s.q, s.k, s.v, args.causal, scale), (s.q, s.k, s.v), s.dout),
                    sets, device, tcfg)
            row.update(fwd_bwd_ms=timing.median_ms, reps=timing.reps,
                       tflops=bc.attention_flops(batch, nheads, n, n, args.head_dim, args.causal,
                                                 "fwd+bwd") / (timing.median_ms * 1e-3) / 1e12)
        except bc.RUN_FAILURES as exc:
            row.update(zip(("status", "reason"), bc.classify_failure(exc)))
        sets = None
        bc.free_memory(device)
        rows.append(row)
        bc.write_csv(rows, out_dir / "recompute.csv")

    # Relative to (a) at the same N, the reference of both trades.
    for row in rows:
        ref = next((r for r in rows if r["seqlen"] == row["seqlen"] and r["variant"] == VARIANTS[0][0]), None)
        ok = row["status"] == bc.STATUS_OK and ref and ref["status"] == bc.STATUS_OK
        row["time_vs_standard"] = row["fwd_bwd_ms"] / ref["fwd_bwd_ms"] if ok else None
        row["peak_vs_standard"] = (row["peak_bytes"] / ref["peak_bytes"]
                                   if ok and ref["peak_bytes"] else None)
    table = [{"N": r["seqlen"], "batch": r["batch"], "variant": r["variant"],
              "fwd+bwd ms": r["fwd_bwd_ms"] if r["status"] == bc.STATUS_OK else r["status"],
              "time vs (a)": f"{r['time_vs_standard']:.2f}x" if r["time_vs_standard"] else "",
              "peak": bc.human_bytes(r["peak_bytes"]) if r["status"] == bc.STATUS_OK else "",
              "peak vs (a)": f"{r['peak_vs_standard']:.2f}x" if r["peak_vs_standard"] else "",
              "saved for bwd": bc.human_bytes(r["saved_activation_bytes"])
              if r["status"] == bc.STATUS_OK else ""} for r in rows]
    print(bc.format_table(table, title=f"\nRecompute vs checkpoint: fwd+bwd of attention, {nheads} heads, "
                          f"d={args.head_dim}, causal={args.causal}, {args.dtype} (checkpoint's saved "
                          "bytes are its inputs only)"))
    summary = {}
    for variant, _, _ in VARIANTS[1:]:
        ratios = [r for r in rows if r["variant"] == variant and r["time_vs_standard"]]
        summary[variant] = {"time_vs_standard": {r["seqlen"]: r["time_vs_standard"] for r in ratios},
                            "peak_vs_standard": {r["seqlen"]: r["peak_vs_standard"] for r in ratios}}
    bc.write_csv(rows, out_dir / "recompute.csv")
    bc.write_json(bc.result_document("recompute", args, device, rows, summary=summary, complete=True),
                  out_dir / "recompute.json")
    print(f"wrote {out_dir}/recompute.csv, .json")
    return bc.ours_exit_code(rows)


if __name__ == "__main__":
    sys.exit(main())
