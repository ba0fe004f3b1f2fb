"""Memory: peak GPU memory of one attention forward + backward against sequence length
(1k..64k), and the bytes each implementation saves for the backward.

Peak = torch.cuda.max_memory_allocated() after a reset, minus what was allocated before
the step (the inputs q, k, v, dout); it includes out and the gradients. Saved bytes come
from torch.autograd.graph.saved_tensors_hooks, once per storage; "activations" excludes
the inputs q, k, v, which exist anyway. Ours should grow linearly in N (it saves out and
the log-sum-exp), the standard implementation quadratically (it saves the N x N
probabilities), until it runs out of memory.

    python benchmarks/bench_memory.py --quick --out results/memory
"""

from __future__ import annotations

import argparse
import math
import sys

import bench_common as bc

DEFAULT_IMPLS = ["ours", "sdpa_flash", "sdpa_math", "materialized"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_common_args(p, default_out="benchmarks/results/memory")
    p.add_argument("--seqlens", type=int, nargs="+", default=None)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--nheads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--impls", nargs="+", default=DEFAULT_IMPLS)
    return p.parse_args(argv)


def apply_defaults(args, device):
    cpu = device.type == "cpu"
    if args.seqlens is None:
        args.seqlens = [64, 128, 256] if cpu else [1024 * 2 ** i for i in range(7)]  # 1k..64k
    args.nheads = args.nheads or (2 if cpu else 16)
    args.head_dim = args.head_dim or (32 if cpu else 64)
    if "ours" not in args.impls:
        args.impls = ["ours"] + list(args.impls)
    return args


def plot(rows, out_dir, title):
    """The paths of the plots written: none without matplotlib."""
    plt = bc.matplotlib_pyplot()
    if plt is None:
        return []
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    colors = {}
    for name in impls:
        ok = sorted((r["seqlen"], r) for r in rows if r["impl"] == name and r["status"] == bc.STATUS_OK)
        failed = sorted(r["seqlen"] for r in rows if r["impl"] == name and r["status"] != bc.STATUS_OK)
        suffix = f" ({rows_status(rows, name)} from N={failed[0]})" if failed else ""
        style = dict(lw=2.5, color="black") if name == "ours" else dict(lw=1.3)
        if ok and ok[0][1]["peak_bytes"] is not None:
            line, = ax.plot([n for n, _ in ok], [r["peak_bytes"] / bc.GiB for _, r in ok],
                            marker="o", ms=3, label=f"{name} peak{suffix}", **style)
            colors[name] = line.get_color()
        if ok:
            ax.plot([n for n, _ in ok], [max(r["saved_activation_bytes"], 1) / bc.GiB for _, r in ok],
                    ls="--", marker="x", ms=3, color=colors.get(name, style.get("color")),
                    lw=1, label=f"{name} saved for bwd")
    ns = sorted({r["seqlen"] for r in rows})
    if len(ns) >= 2:
        # Reference slopes through the smallest point of ours' saved bytes.
        ours = sorted((r["seqlen"], r["saved_activation_bytes"]) for r in rows
                      if r["impl"] == "ours" and r["status"] == bc.STATUS_OK)
        if ours:
            n0, y0 = ours[0][0], max(ours[0][1], 1) / bc.GiB
            ax.plot(ns, [y0 * n / n0 for n in ns], color="gray", lw=0.8, ls=":", label="∝ N")
            ax.plot(ns, [y0 * (n / n0) ** 2 for n in ns], color="gray", lw=0.8, ls="-.", label="∝ N²")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(bc.plain_int_formatter())
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("GiB")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6)
    fig.tight_layout()
    path = out_dir / "memory_vs_seqlen.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [str(path)]


def rows_status(rows, name):
    return "/".join(sorted({r["status"] for r in rows if r["impl"] == name and r["status"] != bc.STATUS_OK}))


def main(argv=None):
    args, device, dtype, out_dir, _, gen, deadline = bc.start_run(parse_args(argv), apply_defaults)
    impls = bc.build_impls(args.impls)
    scale = 1.0 / math.sqrt(args.head_dim)
    rows = []

    def inputs(impl, n):
        return bc.make_attention_inputs(impl.layout, args.batch, n, n, args.nheads, args.nheads,
                                        args.head_dim, dtype, device, gen, requires_grad=True)

    # Warm-up at the smallest N so library workspaces (cuBLAS, cuDNN) are allocated before
    # any peak is read, and sit in the baseline rather than in the first point.
    for impl in impls:
        try:
            bc.fwd_bwd_memory(impl, inputs(impl, args.seqlens[0]), args.causal, scale, device)
        except bc.RUN_FAILURES:
            pass
        bc.free_memory(device)

    failed_from = {}
    points = [(n, impl) for n in args.seqlens for impl in impls]
    for n, impl in bc.progress(points, desc="memory points"):
        row = dict(dtype=args.dtype, seqlen=n, batch=args.batch, nheads=args.nheads,
                   head_dim=args.head_dim, causal=args.causal, impl=impl.name, status=bc.STATUS_OK,
                   reason="", peak_bytes=None, saved_bytes=None, saved_activation_bytes=None)
        if deadline.expired():
            row.update(status=bc.STATUS_SKIPPED, reason="time limit")
        elif impl.name in failed_from:
            # Memory only grows with N: past the first OOM the answer is known, and trying
            # again would only spend time filling the card.
            row.update(status=bc.STATUS_OOM, reason=f"OOM already at N={failed_from[impl.name]}")
        else:
            try:
                row.update(bc.fwd_bwd_memory(impl, inputs(impl, n), args.causal, scale, device))
            except bc.RUN_FAILURES as exc:
                status, reason = bc.classify_failure(exc)
                row.update(status=status, reason=reason)
                if status == bc.STATUS_OOM:
                    failed_from[impl.name] = n
        bc.free_memory(device)
        rows.append(row)
        bc.write_csv(rows, out_dir / "memory.csv")

    table = []
    for n in args.seqlens:
        line = {"N": n}
        for impl in impls:
            r = next(r for r in rows if r["seqlen"] == n and r["impl"] == impl.name)
            ok = r["status"] == bc.STATUS_OK
            line[f"{impl.name} peak"] = bc.human_bytes(r["peak_bytes"]) if ok else r["status"]
            line[f"{impl.name} saved"] = bc.human_bytes(r["saved_activation_bytes"]) if ok else ""
        table.append(line)
    title = (f"fwd+bwd peak memory above inputs and activations saved for backward; "
             f"batch {args.batch}, {args.nheads} heads, d={args.head_dim}, causal={args.causal}, {args.dtype}")
    print(bc.format_table(table, title="\n" + title))
    plots = plot(rows, out_dir, title.replace("; ", ";\n", 1))
    ours_ok = [r for r in rows if r["impl"] == "ours" and r["status"] == bc.STATUS_OK]
    summary = {"ours_max_seqlen": max((r["seqlen"] for r in ours_ok), default=None),
               "ours_peak_at_max_seqlen": ours_ok[-1]["peak_bytes"] if ours_ok else None,
               "first_oom": {name: n for name, n in failed_from.items()}}
    bc.write_json(bc.result_document("memory", args, device, rows, summary=summary,
                                     plots=plots, complete=True), out_dir / "memory.json")
    print(f"wrote {out_dir}/memory.csv, .json and {len(plots)} plot(s)")
    return bc.ours_exit_code(rows)


if __name__ == "__main__":
    sys.exit(main())
