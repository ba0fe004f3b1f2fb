"""The issue-13 grid from one or more bench_attention.py result files: a markdown table with
every implementation's TFLOP/s per (head dim, heads, causal, N, mode), ours / the best peer,
and a plot of that ratio across the grid. fwd+bwd is formed from fwd and bwd where both were
timed (their FLOPs add: 3.5 x the forward's). Runs split by head dim (to fit device calls)
merge here; a cell measured in more than one file is an error, since ratios are only valid
within one run.

    python benchmarks/grid_report.py OUT/grid_d64/attention_speed.csv OUT/grid_d128/... \\
        [--peers fa4 sdpa_cudnn] [--out grid.md]   (grid.png beside it)
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import bench_common as bc

MODE_ORDER = ("fwd", "bwd", "fwd_bwd")
# FLOPs of each mode in units of the forward's: the backward is 2.5 x.
MODE_WEIGHT = {"fwd": 1.0, "bwd": 2.5}


def load_cells(paths):
    """{(head_dim, nheads, nheads_kv, causal, seqlen, mode): {impl: tflops or status}}."""
    cells, origin = {}, {}
    for path in paths:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                key = (int(row["head_dim"]), int(row["nheads"]), int(row.get("nheads_kv") or row["nheads"]),
                       row["causal"] == "True", int(row["seqlen"]), row["mode"])
                where = origin.setdefault((key, row["impl"]), path)
                if where != path:
                    raise SystemExit(f"{row['impl']} {key} is in both {where} and {path}: "
                                     "compare only within one run")
                ok = row["status"] == bc.STATUS_OK and row["tflops"] not in ("", None)
                cells.setdefault(key, {})[row["impl"]] = float(row["tflops"]) if ok else row["status"]
    return add_fwd_bwd(cells)


def add_fwd_bwd(cells):
    """fwd+bwd TFLOP/s of each implementation timed in both modes: total FLOPs over total time."""
    for key in [k for k in cells if k[-1] == "fwd"]:
        fwd, bwd = cells[key], cells.get(key[:-1] + ("bwd",), {})
        both = {}
        for impl, f in fwd.items():
            b = bwd.get(impl)
            if isinstance(f, float) and isinstance(b, float):
                seconds = MODE_WEIGHT["fwd"] / f + MODE_WEIGHT["bwd"] / b   # per unit of forward FLOPs
                both[impl] = (MODE_WEIGHT["fwd"] + MODE_WEIGHT["bwd"]) / seconds
        if both:
            cells[key[:-1] + ("fwd_bwd",)] = both
    return cells


def best_peer_ratio(values, peers):
    ours = values.get("ours")
    timed = [values[p] for p in peers if isinstance(values.get(p), float)]
    if not isinstance(ours, float) or not timed:
        return None
    return ours / max(timed)


def table(cells, peers):
    impls = ["ours"] + list(peers)
    head = ("| d | heads q/kv | causal | N | mode | " + " | ".join(impls) + " | ours / best peer |\n"
            "|" + " --- |" * (6 + len(impls)) + "\n")
    lines = []
    for key in sorted(cells, key=lambda k: (k[0], k[1], k[2], k[3], MODE_ORDER.index(k[5]), k[4])):
        d, hq, hkv, causal, n, mode = key
        values = cells[key]
        shown = [f"{values[i]:.0f}" if isinstance(values.get(i), float) else str(values.get(i, "-"))
                 for i in impls]
        ratio = best_peer_ratio(values, peers)
        lines.append(f"| {d} | {hq}/{hkv} | {'yes' if causal else 'no'} | {n} | {mode} | "
                     + " | ".join(shown) + f" | {'-' if ratio is None else f'{ratio:.2f}'} |")
    return head + "\n".join(lines) + "\n"


def plot(cells, peers, path):
    plt = bc.matplotlib_pyplot()
    if plt is None:
        return None
    modes = [m for m in MODE_ORDER if any(k[-1] == m for k in cells)]
    fig, axes = plt.subplots(1, len(modes), squeeze=False, figsize=(4.5 * len(modes), 3.6))
    for ax, mode in zip(axes[0], modes):
        series = sorted({k[:4] for k in cells if k[-1] == mode})
        for d, hq, hkv, causal in series:
            pts = sorted((k[4], best_peer_ratio(v, peers)) for k, v in cells.items()
                         if k[:4] == (d, hq, hkv, causal) and k[-1] == mode)
            pts = [(n, r) for n, r in pts if r is not None]
            if pts:
                gqa = f" {hq}/{hkv}" if hq != hkv else ""
                ax.plot([n for n, _ in pts], [r for _, r in pts], marker="o", ms=3,
                        ls="--" if causal else "-", label=f"d {d}{gqa}{' causal' if causal else ''}")
        ax.axhline(1.0, color="black", lw=1)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(bc.plain_int_formatter())
        ax.set_title(f"{mode}: ours / best of {', '.join(peers)}", fontsize=9)
        ax.set_xlabel("seqlen")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", nargs="+", type=Path, help="attention_speed.csv files of bench_attention.py")
    p.add_argument("--peers", nargs="+", default=None,
                   help="the peers of 'best peer' (default: every implementation but ours)")
    p.add_argument("--out", type=Path, default=None, help="write the table here (and the plot as .png)")
    args = p.parse_args(argv)
    cells = load_cells(args.csv)
    peers = args.peers or sorted({i for v in cells.values() for i in v} - {"ours", "ours_deterministic"})
    text = table(cells, peers)
    sys.stdout.write(text)
    if args.out:
        args.out.write_text(text)
        where = plot(cells, peers, args.out.with_suffix(".png"))
        if where:
            print(f"wrote {args.out} and {where}")


if __name__ == "__main__":
    main()
