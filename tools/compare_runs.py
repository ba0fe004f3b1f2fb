"""The table of an A/B comparison of two builds (tools/compare_builds.sh): runs A1 B1 A2 B2 of
one benchmark, each in DEST/<run>/, merged per measured point into the two builds' means, B / A
and the noise (the larger spread between a build's own two runs, relative to its mean), which a
difference between the builds has to beat.

    python3 tools/compare_runs.py DEST [--bench attention|decode]

attention: bench_attention.py's attention_speed.csv, TFLOP/s of ours per (d, causal, N, mode).
decode: bench_decode.py's decode.csv, GB/s of K/V read per (impl, KV heads, batch, keys): every
implementation, the peers too, whose B / A (the same peer in both runs) shows what the machine's
drift alone does.
"""
import argparse
import csv
import pathlib
import statistics

RUNS = ("A1", "A2", "B1", "B2")
BENCHES = {
    # csv file, key columns, value column, rows kept
    "attention": ("attention_speed.csv", ("head_dim", "causal", "seqlen", "mode"), "tflops",
                  lambda row: row["impl"] == "ours"),
    "decode": ("decode.csv", ("head_dim", "impl", "nheads_kv", "batch", "kv_len"), "kv_gbps", lambda row: True),
}


def load(path, keys, value, keep):
    with open(path, newline="") as f:
        return {tuple(row[k] for k in keys): float(row[value])
                for row in csv.DictReader(f) if row["status"] == "ok" and keep(row)}


def sort_key(key):
    return tuple((0, int(part), "") if part.lstrip("-").isdigit() else (1, 0, part) for part in key)


def compare(dest, bench):
    file_name, keys, value, keep = BENCHES[bench]
    runs = {label: load(pathlib.Path(dest) / label / file_name, keys, value, keep) for label in RUNS}
    points = [key for key in sorted(runs["A1"], key=sort_key) if all(key in runs[label] for label in RUNS)]
    widths = [max([len(k)] + [len(key[i]) for key in points]) for i, k in enumerate(keys)]
    lines = [" ".join(f"{k:>{w}}" for k, w in zip(keys, widths)) + " | " +
             " ".join(f"{label:>7}" for label in RUNS) + " |   B/A  noise"]
    ratios = []
    for key in points:
        vals = [runs[label][key] for label in RUNS]
        a, b = statistics.mean(vals[:2]), statistics.mean(vals[2:])
        noise = max(abs(vals[0] - vals[1]) / a, abs(vals[2] - vals[3]) / b)
        ratios.append(b / a)
        lines.append(" ".join(f"{k:>{w}}" for k, w in zip(key, widths)) + " | " +
                     " ".join(f"{v:7.0f}" for v in vals) + f" | {b / a:.3f} {noise:.3f}")
    if ratios:
        lines.append(f"B/A from {min(ratios):.3f} to {max(ratios):.3f} over {len(ratios)} points")
    else:
        lines.append("no point was measured in all four runs")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dest", help="the folder holding A1, A2, B1, B2")
    p.add_argument("--bench", choices=sorted(BENCHES), default="attention")
    args = p.parse_args()
    print(compare(args.dest, args.bench))


if __name__ == "__main__":
    main()
