"""The developer tools that run without a GPU: tools/ncu_hotspots.py on a small source page
laid out as Nsight Compute writes it (--page source --csv --print-source sass),
tools/compare_runs.py on the four runs of an A/B comparison as the benchmarks write them, and
tools/decode_timeline.py's reading of a profiler trace."""

import csv
import importlib.util
import pathlib
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "stall_barrier", "stall_long_sb", "stall_wait", "stall_barrier (Not Issued)",
          "stall_long_sb (Not Issued)", "stall_wait (Not Issued)", "Instructions Executed"]
# (source, barrier, long_sb, wait, executed): 100 samples in all; a loop of two instructions
# (FFMA, BAR) run 8 times per run of the code around it.
INSTRUCTIONS = [
    ("LDG.E R2, desc[UR4][R4.64]", 0, 0, 2, 16),
    ("IMAD R3, R3, R2, RZ", 0, 1, 1, 16),
    ("FFMA R5, R2, R3, R5", 0, 60, 2, 128),
    ("BAR.SYNC 0x1, 0x100", 30, 0, 0, 128),
    ("EXIT", 0, 0, 4, 16),
]


def hotspots(path, *args):
    return subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "ncu_hotspots.py"), str(path), *args],
                          capture_output=True, text=True, timeout=60)


def write_source_page(tmp_path):
    page = tmp_path / "sass.csv"
    with open(page, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Kernel Name", "void attention_backward_sm90_kernel<...>(...)"])
        writer.writerow(HEADER)
        for i, (source, barrier, long_sb, wait, executed) in enumerate(INSTRUCTIONS):
            total = barrier + long_sb + wait
            writer.writerow([hex(0x100 + 16 * i), source, total, total, barrier, long_sb, wait, 0, 0, 0, executed])
    return page


def test_ncu_hotspots_charges_each_instruction_its_samples(tmp_path):
    proc = hotspots(write_source_page(tmp_path), "--top", "2", "--context", "1")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "5 instructions, 100 samples"
    assert lines[1] == "by reason: long_sb 61.0 %, barrier 30.0 %, wait 9.0 %"
    marked = [line for line in lines if line.startswith("  >>> ")]
    assert len(marked) == 2
    assert "FFMA" in marked[0] and "62.0 %" in marked[0] and "[long_sb 60.0, wait 2.0]" in marked[0]
    assert "BAR.SYNC" in marked[1] and "30.0 %" in marked[1] and "[barrier 30.0]" in marked[1]
    # One instruction of context before each: the IMAD above the FFMA, the FFMA above the BAR.
    assert any("IMAD" in line for line in lines[lines.index(marked[0]) - 1:lines.index(marked[0])])


def test_ncu_hotspots_names_a_file_without_a_source_page(tmp_path):
    page = tmp_path / "details.csv"
    page.write_text('"Kernel Name","k"\n"Metric Name","Metric Value"\n')
    proc = hotspots(page)
    assert proc.returncode != 0
    assert "has no source-page header" in proc.stderr


def test_ncu_hotspots_regions_group_samples_by_how_often_the_code_ran(tmp_path):
    proc = hotspots(write_source_page(tmp_path), "--regions", "5")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    counts = lines[lines.index("by execution count:") + 1:lines.index("runs of equal count with 5.0 % or more:")]
    # The loop (128 executions): 92 of the 100 samples; the code around it (16): 8, in two runs.
    assert [line.split() for line in counts] == [["128", "x", "2", "instructions", "92.0", "%"],
                                                 ["16", "x", "3", "instructions", "8.0", "%"]]
    runs = lines[lines.index("runs of equal count with 5.0 % or more:") + 1:]
    assert len(runs) == 1 and runs[0].split()[:6] == ["2-", "3", "128", "x", "2", "instructions"]


def write_decode_runs(tmp_path, gbps):
    """Four runs of bench_decode.py's decode.csv: gbps[run] = {(impl, batch): GB/s}; a point
    that a run skipped has status 'skipped'."""
    columns = ["dtype", "batch", "kv_len", "nheads", "nheads_kv", "head_dim", "impl", "status", "kv_gbps"]
    for run, points in gbps.items():
        (tmp_path / run).mkdir()
        with open(tmp_path / run / "decode.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            for (impl, batch), value in points.items():
                writer.writerow(dict(dtype="bf16", batch=batch, kv_len=32768, nheads=32, nheads_kv=8, head_dim=128,
                                     impl=impl, status="ok" if value else "skipped", kv_gbps=value or ""))


def test_compare_runs_merges_the_four_runs_per_point(tmp_path):
    write_decode_runs(tmp_path, {
        "A1": {("ours", 1): 1000.0, ("ours", 8): 3000.0, ("sdpa_cudnn", 1): 2000.0},
        "A2": {("ours", 1): 1100.0, ("ours", 8): 3000.0, ("sdpa_cudnn", 1): 2000.0},
        "B1": {("ours", 1): 1260.0, ("ours", 8): 3300.0, ("sdpa_cudnn", 1): 2000.0},
        "B2": {("ours", 1): 1260.0, ("ours", 8): None, ("sdpa_cudnn", 1): 2000.0},
    })
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "compare_runs.py"), str(tmp_path),
                           "--bench", "decode"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()]
    # Batch 8 was skipped in B2: no row. Batch 1: A 1050, B 1260 -> 1.200; noise 100 / 1050.
    assert rows[1] == ["128", "ours", "8", "1", "32768", "|", "1000", "1100", "1260", "1260", "|", "1.200", "0.095"]
    assert rows[2][:2] == ["128", "sdpa_cudnn"] and rows[2][-2:] == ["1.000", "0.000"]
    assert rows[3] == ["B/A", "from", "1.000", "to", "1.200", "over", "2", "points"]


def load_decode_timeline():
    spec = importlib.util.spec_from_file_location("decode_timeline", REPO_ROOT / "tools" / "decode_timeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_decode_timeline_cuts_a_trace_into_calls():
    timeline_tool = load_decode_timeline()
    # Two replays of a graph of three calls; a call: the attention kernel (8 us), then the
    # combine (2 us), which starts 0.5 us before the attention kernel ends; the next call
    # 1 us after the combine; each replay starts with a kernel of its own (1 us), its first call
    # 5 us after that.
    attention = "void flashattn::kvcache_forward_kernel<__nv_bfloat16, flashattn::Shape<128>>(flashattn::Params)"
    events, t = [], 100.0
    for _ in range(2):
        events.append(dict(cat="kernel", name="fill", ts=t, dur=1.0))
        t += 6.0
        for _ in range(3):
            events.append(dict(cat="kernel", name=attention, ts=t, dur=8.0))
            events.append(dict(cat="kernel", name="combine", ts=t + 7.5, dur=2.0))
            t += 10.5
    events.append(dict(cat="cuda_runtime", name="cudaGraphLaunch", ts=90.0, dur=3.0))
    kernels = timeline_tool.kernel_events({"traceEvents": events[::-1]})
    assert [k.start_us for k in kernels] == sorted(k.start_us for k in kernels) and len(kernels) == 14
    timeline = timeline_tool.call_timeline(kernels, calls=6)
    assert timeline.dropped == 2 and timeline.calls == 6
    assert [s.name for s in timeline.slots] == [attention, "combine"]
    assert [s.duration_us for s in timeline.slots] == [8.0, 2.0]
    # The attention kernel's gaps: 1 us within a replay (4 of 5), 7 us across.
    assert [s.gap_us for s in timeline.slots] == [1.0, -0.5]
    assert timeline.period_us == 10.5 and timeline.busy_us == 9.5 and timeline.idle_us == 1.0
    assert timeline_tool.short_name(attention) == "kvcache_forward_kernel"
    # One call's kernels in the other order: no pattern.
    swapped = list(kernels)
    swapped[1], swapped[2] = swapped[1]._replace(name="combine"), swapped[2]._replace(name=attention)
    with pytest.raises(ValueError, match="do not repeat"):
        timeline_tool.call_timeline(swapped, calls=6)
