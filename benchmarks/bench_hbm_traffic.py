"""HBM traffic (the IO-complexity theorem): DRAM bytes read and written by one forward of
ours and of the standard implementation, from hardware counters via Nsight Compute:

    ncu --metrics dram__bytes_read.sum,dram__bytes_write.sum --clock-control none --csv ...

run on hbm_target.py for several N and d. Bytes are summed over all kernels of each
forward (the standard one is several kernels: QK^T, scale, softmax, PV). ncu flushes the
caches before each kernel (its default --cache-control all), so each kernel starts cold.

Beside the measurement, the model: standard attention moves Theta(N*d + N^2) elements
per head, FlashAttention Theta(N^2 * d^2 / M) with M the on-chip memory in elements
(shared memory per SM, from torch.cuda.get_device_properties, else 228 KiB). The model
is shown with all constants set to 1, so only its ratio and its trend are comparable;
the measured ratio is "k x fewer HBM bytes".

On cpu (no ncu) the target is run directly to dry-run the forwards, and nothing is
measured. --parse CSV --manifest JSON re-reads a saved ncu log without a GPU.

    python benchmarks/bench_hbm_traffic.py --quick --out results/hbm
"""

from __future__ import annotations

import argparse
import csv
import glob
import io
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import bench_common as bc

TARGET = Path(__file__).resolve().parent / "hbm_target.py"
METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
SENTINEL_KERNEL = "spin_kernel"   # what torch.cuda._sleep launches; see hbm_target.py
STANDARD_IMPLS = {"materialized", "sdpa_math"}
DEFAULT_IMPLS = ["ours", "materialized", "sdpa_flash"]

# ncu prints base units with --print-units base; the others are accepted for older logs.
BYTE_UNITS = {"": 1, "byte": 1, "bytes": 1, "b": 1, "kbyte": 1e3, "kb": 1e3, "mbyte": 1e6, "mb": 1e6,
              "gbyte": 1e9, "gb": 1e9, "tbyte": 1e12, "tb": 1e12, "kib": 1024, "mib": 2 ** 20,
              "gib": 2 ** 30}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_common_args(p, default_out="benchmarks/results/hbm")
    p.add_argument("--seqlens", type=int, nargs="+", default=None)
    p.add_argument("--head-dims", type=int, nargs="+", default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--nheads", type=int, default=None)
    p.add_argument("--impls", nargs="+", default=DEFAULT_IMPLS)
    p.add_argument("--ncu", default=None, help="path of ncu (default: PATH, then /usr/local/cuda/bin)")
    p.add_argument("--parse", metavar="CSV", default=None,
                   help="only parse this saved ncu CSV log (needs --manifest)")
    p.add_argument("--manifest", default=None, help="manifest written by hbm_target.py")
    p.add_argument("--self-test", action="store_true", help="test the ncu CSV parser and exit")
    return p.parse_args(argv)


def apply_defaults(args, device):
    cpu = device.type == "cpu"
    if args.seqlens is None:
        args.seqlens = [64, 128] if cpu else ([1024, 4096] if args.quick else [1024, 2048, 4096, 8192, 16384])
    if args.head_dims is None:
        args.head_dims = [32] if cpu else ([64, 128] if args.quick else [64, 128, 256])
    args.batch = args.batch or (1 if cpu else 2)
    args.nheads = args.nheads or (2 if cpu else 16)
    if "ours" not in args.impls:
        args.impls = ["ours"] + list(args.impls)
    return args


def find_ncu(explicit):
    candidates = [explicit, shutil.which("ncu"), "/usr/local/cuda/bin/ncu"]
    candidates += sorted(glob.glob("/usr/local/cuda*/bin/ncu"), reverse=True)
    candidates += sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"), reverse=True)
    for candidate in candidates:
        if candidate and os.path.exists(candidate):
            return candidate
    return None


# --------------------------------------------------------------------------- ncu CSV

def metric_bytes(value: str, unit: str) -> float:
    number = float(value.replace(",", "").strip())
    factor = BYTE_UNITS.get(unit.strip().lower())
    if factor is None:
        raise ValueError(f"unexpected unit {unit!r} for a byte metric")
    return number * factor


def parse_ncu_csv(text: str) -> list[dict]:
    """Kernels in launch order: {"id", "name", metric: bytes...} from ncu --csv output
    (one row per kernel and metric). Lines ncu adds around the CSV (==PROF==, the
    application's own output) are skipped."""
    lines = text.splitlines()
    header_at = next((i for i, line in enumerate(lines)
                      if line.startswith('"') and '"Metric Name"' in line), None)
    if header_at is None:
        return []
    rows = csv.DictReader(io.StringIO("\n".join(
        line for line in lines[header_at:] if line.startswith('"'))))
    kernels: dict[int, dict] = {}
    for row in rows:
        if row.get("Metric Name") not in METRICS:
            continue
        kid = int(row["ID"])
        name = row.get("Kernel Name") or row.get("Function Name") or "?"
        k = kernels.setdefault(kid, {"id": kid, "name": name})
        k[row["Metric Name"]] = metric_bytes(row["Metric Value"], row.get("Metric Unit", "byte"))
    return [kernels[i] for i in sorted(kernels)]


def group_by_sentinel(kernels: list[dict]) -> list[list[dict]]:
    """Splits the kernel list at each sentinel; kernels before the first one (none are
    expected with --profile-from-start off) are dropped."""
    groups: list[list[dict]] = []
    for k in kernels:
        if SENTINEL_KERNEL in k["name"]:
            groups.append([])
        elif groups:
            groups[-1].append(k)
    return groups


def attach_measurements(manifest: list[dict], groups: list[list[dict]]) -> list[dict]:
    opened = [e for e in manifest if e.get("sentinel_launched")]
    if len(groups) < len(opened):
        # A run cut short (time limit, killed) leaves the last entries without results;
        # more groups than entries would mean the mapping itself is wrong.
        print(f"warning: {len(groups)} kernel groups for {len(opened)} profiled forwards; "
              "the last ones have no counters", file=sys.stderr)
    elif len(groups) > len(opened):
        raise SystemExit(f"{len(groups)} kernel groups in the ncu log but only {len(opened)} "
                         "profiled forwards in the manifest: cannot attribute the counters")
    for entry, group in zip(opened, groups):
        if not group:
            entry.update(status=bc.STATUS_ERROR, reason="no kernel after the sentinel")
            continue
        entry["kernels"] = len(group)
        entry["kernel_names"] = "; ".join(sorted({k["name"][:80] for k in group}))
        entry["dram_read_bytes"] = sum(k.get(METRICS[0], math.nan) for k in group)
        entry["dram_write_bytes"] = sum(k.get(METRICS[1], math.nan) for k in group)
        entry["dram_bytes"] = entry["dram_read_bytes"] + entry["dram_write_bytes"]
    for entry in manifest:
        if entry["status"] == bc.STATUS_OK and "dram_bytes" not in entry:
            entry.update(status="unmeasured", reason=entry.get("reason") or "no counters")
    return manifest


def self_test() -> int:
    """Parses a small ncu-format log (two forwards, one of three kernels) and checks the
    grouping and the sums, so the parser can be tested without a GPU."""
    header = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
              '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
              '"Metric Value"')
    kernels = [("at::cuda::(anonymous namespace)::spin_kernel(long)", "0", "0"),
               ("flash_fwd_kernel", "1,000,000", "250,000"),
               ("at::cuda::(anonymous namespace)::spin_kernel(long)", "0", "0"),
               ("sm90_gemm", "2,000", "8,000"), ("softmax_warp_forward", "8,000", "8,000"),
               ("sm90_gemm", "9,000", "1,000")]
    lines = ["==PROF== Connected to process 1", header]
    for i, (name, read, write) in enumerate(kernels):
        for metric, value in zip(METRICS, (read, write)):
            lines.append(f'"{i}","1","python","h","{name}","1","7","(1, 1, 1)","(1, 1, 1)","0",'
                         f'"9.0","Command line profiler metrics","{metric}","byte","{value}"')
    manifest = [dict(impl="ours", seqlen=64, head_dim=32, batch=1, nheads=1, status="ok",
                     sentinel_launched=True),
                dict(impl="sdpa_math", seqlen=64, head_dim=32, batch=1, nheads=1, status="—",
                     sentinel_launched=False),
                dict(impl="materialized", seqlen=64, head_dim=32, batch=1, nheads=1, status="ok",
                     sentinel_launched=True)]
    entries = attach_measurements(manifest, group_by_sentinel(parse_ncu_csv("\n".join(lines))))
    assert entries[0]["dram_bytes"] == 1_250_000 and entries[0]["kernels"] == 1, entries[0]
    assert "dram_bytes" not in entries[1] and entries[1]["status"] == "—", entries[1]
    assert entries[2]["dram_read_bytes"] == 19_000 and entries[2]["dram_write_bytes"] == 17_000
    assert entries[2]["kernels"] == 3
    print("bench_hbm_traffic self-test: ok")
    return 0


# --------------------------------------------------------------------------- model

def add_model(entries: list[dict], smem_bytes: int) -> None:
    for e in entries:
        elem = 2  # bf16 / fp16
        n, d, bh = e["seqlen"], e["head_dim"], e["batch"] * e["nheads"]
        m_elems = smem_bytes / elem
        e["model_standard_bytes"] = bh * (n * d + n * n) * elem
        e["model_flash_bytes"] = bh * (n * n * d * d / m_elems) * elem
        e["model_bytes"] = e["model_standard_bytes"] if e["impl"] in STANDARD_IMPLS else e["model_flash_bytes"]
        # The least any forward can move: read Q, K, V once and write O once.
        e["minimal_bytes"] = 4 * bh * n * d * elem
        e["smem_per_sm_bytes"] = smem_bytes


def ratio_table(entries: list[dict]) -> list[dict]:
    table = []
    for n, d in dict.fromkeys((e["seqlen"], e["head_dim"]) for e in entries):
        group = {e["impl"]: e for e in entries if (e["seqlen"], e["head_dim"]) == (n, d)}
        ours = group.get("ours")
        line = {"N": n, "d": d}
        for name, e in group.items():
            line[f"{name} MB"] = e["dram_bytes"] / 1e6 if "dram_bytes" in e else e["status"]
        if ours and "dram_bytes" in ours:
            line["ours / minimal"] = f"{ours['dram_bytes'] / ours['minimal_bytes']:.2f}x"
            for name, e in group.items():
                if name != "ours" and "dram_bytes" in e:
                    # "ours moves k x fewer HBM bytes than <name>"
                    line[f"ours vs {name}"] = f"{e['dram_bytes'] / ours['dram_bytes']:.1f}x fewer"
        any_e = next(iter(group.values()))
        line["model std / flash"] = f"{any_e['model_standard_bytes'] / any_e['model_flash_bytes']:.1f}x"
        table.append(line)
    return table


# --------------------------------------------------------------------------- driver

def target_command(args, manifest_path, device):
    configs = [f"{n}:{d}" for d in args.head_dims for n in args.seqlens]
    cmd = [sys.executable, str(TARGET), "--device", device.type, "--dtype", args.dtype,
           "--batch", str(args.batch), "--nheads", str(args.nheads), "--manifest",
           str(manifest_path), "--seed", str(args.seed), "--configs", *configs,
           "--impls", *args.impls]
    if args.time_limit_s is not None:
        cmd += ["--time-limit-s", str(args.time_limit_s)]
    return cmd


def main(argv=None):
    args = parse_args(argv)
    if args.self_test:
        return self_test()
    device = bc.resolve_device(args.device)
    args = apply_defaults(args, device)
    out_dir = bc.ensure_out_dir(args.out)
    manifest_path = Path(args.manifest) if args.manifest else out_dir / "hbm_manifest.json"
    csv_path = Path(args.parse) if args.parse else out_dir / "hbm_ncu.csv"
    measured = True

    if args.parse:
        if not args.manifest:
            raise SystemExit("--parse needs --manifest")
    else:
        bc.import_ours(device)
        cmd = target_command(args, manifest_path, device)
        ncu = find_ncu(args.ncu) if bc.is_cuda(device) else None
        if bc.is_cuda(device) and ncu is None:
            raise SystemExit("ncu (Nsight Compute) not found on PATH, in /usr/local/cuda*/bin nor "
                             "in /opt/nvidia/nsight-compute; pass --ncu PATH")
        if ncu:
            cmd = [ncu, "--metrics", ",".join(METRICS), "--clock-control", "none", "--csv",
                   "--print-units", "base", "--profile-from-start", "off",
                   "--target-processes", "all", "--log-file", str(csv_path)] + cmd
        else:
            measured = False
            print("no GPU: running the target without ncu (a dry run of the forwards; nothing "
                  "is measured)", flush=True)
        print("running: " + " ".join(cmd), flush=True)
        timeout = None if args.time_limit_s is None else args.time_limit_s + 90
        try:
            proc = subprocess.run(cmd, timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        if rc != 0:
            print(f"target/ncu exited with {rc}", file=sys.stderr)
            if ncu and csv_path.exists():
                print("last lines of the ncu log:\n" + "\n".join(
                    csv_path.read_text(errors="replace").splitlines()[-20:]), file=sys.stderr)
            if not manifest_path.exists():
                return 1

    manifest = json.loads(manifest_path.read_text())
    if measured:
        text = csv_path.read_text(errors="replace") if csv_path.exists() else ""
        entries = attach_measurements(manifest, group_by_sentinel(parse_ncu_csv(text)))
    else:
        entries = [dict(e, status=e["status"] if e["status"] != bc.STATUS_OK else "unmeasured",
                        reason=e.get("reason") or "dry run without ncu") for e in manifest]
    add_model(entries, bc.shared_memory_per_sm_bytes(device))
    bc.write_csv(entries, out_dir / "hbm_traffic.csv")
    table = ratio_table(entries)
    print(bc.format_table(table, title=f"\nDRAM bytes of one forward (ncu, MB = 1e6 bytes), batch "
                          f"{args.batch}, {args.nheads} heads, {args.dtype}, non-causal; model "
                          f"Theta(Nd+N^2) vs Theta(N^2 d^2/M), M = "
                          f"{bc.shared_memory_per_sm_bytes(device) // 1024} KiB / 2 bytes"))
    ours = [e for e in entries if e["impl"] == "ours" and "dram_bytes" in e]
    fewer = {f"N{e['seqlen']}_d{e['head_dim']}": (
        next((o["dram_bytes"] for o in entries if o["impl"] == "materialized"
              and (o["seqlen"], o["head_dim"]) == (e["seqlen"], e["head_dim"]) and "dram_bytes" in o),
             math.nan) / e["dram_bytes"]) for e in ours}
    bc.write_json(bc.result_document("hbm_traffic", args, device, entries, table=table,
                                     summary={"standard_over_ours_bytes": fewer,
                                              "measured": measured}, complete=True),
                  out_dir / "hbm_traffic.json")
    print(f"wrote {out_dir}/hbm_traffic.csv, .json" + (f" (raw ncu log {csv_path})" if measured else ""))
    if measured and not ours:
        print("ERROR: no counters for ours", file=sys.stderr)
        return 4
    return bc.ours_exit_code(entries)


if __name__ == "__main__":
    sys.exit(main())
