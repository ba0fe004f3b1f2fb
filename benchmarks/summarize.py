"""Short summary of a run_all.sh output directory: one line per claim, read from the
JSON files the benchmarks wrote, plus the environment and each step's exit status.
Printed, and written to OUT_DIR/summary.md for RESULTS.md.

    python benchmarks/summarize.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import bench_common as bc
from bench_e2e import run_label


def load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def fmt(x, spec=".2f", suffix=""):
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


def attention_lines(doc):
    lines = []
    unit, per_unit = bc.flops_unit((doc.get("environment") or {}).get("device", "cuda"))
    for mode, s in (doc.get("summary") or {}).items():
        best = s.get("ours_max_tflops")
        peers = ", ".join(f"{k.removeprefix('geomean_speedup_vs_')} {fmt(v, '.2f', 'x')}"
                          for k, v in s.items() if k.startswith("geomean_speedup_vs_"))
        lines.append(("kernel speed", f"{mode}: ours up to {fmt(best and best * 1e12 / per_unit, '.3g')} {unit}; "
                      f"geomean speedup vs {peers}"
                      + (f"; ours not ok on {s['ours_not_ok']} shapes" if s.get("ours_not_ok") else "")))
    rows = doc.get("rows", [])
    for mode in ("fwd", "bwd"):
        head = {r["impl"]: r for r in rows if r["head_dim"] == 128 and r["seqlen"] == 8192
                and not r["causal"] and r["mode"] == mode}
        if head.get("ours"):
            cells = ", ".join(f"{name} {fmt(r['tflops'], '.0f') if r['status'] == 'ok' else r['status']}"
                              for name, r in head.items())
            lines.append(("kernel speed", f"headline d128 N8k non-causal {mode} TFLOP/s: {cells}"))
    return lines


def decode_lines(doc):
    s = doc.get("summary") or {}
    frac = s.get("ours_max_fraction_of_copy_bw")
    return [("decoding", f"ours up to {fmt(s.get('ours_max_kv_gbps'), '.0f')} GB/s of K/V read = "
             f"{fmt(None if frac is None else 100 * frac, '.0f', '%')} of the measured copy bandwidth "
             f"{fmt(s.get('copy_bandwidth_gbps'), '.0f')} GB/s")]


def memory_lines(doc):
    s = doc.get("summary") or {}
    rows = doc.get("rows", [])
    ns = sorted({r["seqlen"] for r in rows if r["status"] == "ok"})
    common = [n for n in ns if all(r["status"] == "ok" for r in rows if r["seqlen"] == n)]
    ratio = ""
    if common:
        n = common[-1]
        by = {r["impl"]: r for r in rows if r["seqlen"] == n}
        if by.get("ours", {}).get("peak_bytes") and by.get("materialized", {}).get("peak_bytes"):
            ratio = (f"; at N={n} materialized peak / ours = "
                     f"{by['materialized']['peak_bytes'] / by['ours']['peak_bytes']:.1f}x")
    ooms = ", ".join(f"{k} OOM from N={v}" for k, v in (s.get("first_oom") or {}).items())
    return [("memory", f"ours runs to N={s.get('ours_max_seqlen')} (peak "
             f"{bc.human_bytes(s.get('ours_peak_at_max_seqlen'))}); {ooms or 'no OOM'}{ratio}")]


def hbm_lines(doc):
    s = doc.get("summary") or {}
    if not s.get("measured"):
        return [("HBM traffic", "not measured (no ncu / no GPU)")]
    cells = ", ".join(f"{k} {fmt(v, '.1f', 'x')}" for k, v in (s.get("standard_over_ours_bytes") or {}).items())
    return [("HBM traffic", f"standard / ours DRAM bytes: {cells}")]


def recompute_lines(doc):
    lines = []
    for variant, s in (doc.get("summary") or {}).items():
        t = ", ".join(f"N{n} {fmt(v, '.2f', 'x')}" for n, v in s.get("time_vs_standard", {}).items())
        m = ", ".join(f"N{n} {fmt(v, '.2f', 'x')}" for n, v in s.get("peak_vs_standard", {}).items())
        lines.append(("recompute", f"{variant}: time vs standard {t}; peak vs standard {m}"))
    return lines


def e2e_lines(doc):
    rows = doc.get("rows", [])
    lines = []

    def is_ours_run(r):
        # In gpt2_packed ours runs packed; its padded run is one of the compared peers.
        return r["impl"] == "ours" and r.get("layout") != "padded"

    for model in dict.fromkeys(r["model"] for r in rows):
        cells = []
        for r in rows:
            if r["model"] == model and not is_ours_run(r):
                cells.append(f"seq{r['seqlen']} vs {run_label(r)} "
                             + (fmt(r.get("ours_speedup"), ".2f", "x") if r.get("ours_speedup")
                                else r["status"]))
        ours = [r for r in rows if r["model"] == model and is_ours_run(r)]
        bad = [f"seq{r['seqlen']} {r['status']}" for r in ours if r["status"] != "ok"]
        lines.append(("end-to-end", f"{model} ({doc.get('model_source')}) ours tokens/s speedup: "
                      + ", ".join(cells) + (f"; ours {', '.join(bad)}" if bad else "")))
    return lines


SECTIONS = [("attention/attention_speed.json", attention_lines), ("decode/decode.json", decode_lines),
            ("memory/memory.json", memory_lines), ("hbm/hbm_traffic.json", hbm_lines),
            ("recompute/recompute.json", recompute_lines), ("e2e/e2e.json", e2e_lines)]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    out_dir = Path(argv[0] if argv else "benchmarks/results")
    lines, env = [], None
    for rel, fn in SECTIONS:
        doc = load(out_dir / rel)
        if doc is None:
            lines.append((rel.split("/")[0], f"no results ({rel} missing: see logs/)"))
            continue
        env = env or doc.get("environment")
        lines += fn(doc)
    steps = (out_dir / "logs" / "steps.txt")
    text = ["# Benchmark summary", ""]
    if env and env.get("device") == "cpu":
        text.append(f"- {bc.DRY_RUN_NOTE}")
    if env:
        text.append(f"- date {env.get('date_utc')}, GPU {env.get('gpu', env.get('device'))}, driver "
                    f"{env.get('driver')}, torch {env.get('torch')} (CUDA {env.get('torch_cuda')}, cuDNN "
                    f"{env.get('cudnn')}), flashattn_ext {env.get('flashattn_ext')} @ "
                    f"{(env.get('git_commit') or 'unknown')[:12]}")
    if steps.exists():
        text.append("- steps: " + "; ".join(steps.read_text().split("\n")).strip("; "))
    text.append("")
    text += [f"- **{claim}**: {measured}" for claim, measured in lines]
    out = "\n".join(text)
    print(out)
    if out_dir.is_dir():
        (out_dir / "summary.md").write_text(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
