"""The benchmarks after the README's setup (installed package, no matplotlib): tiny
cpu dry runs of bench_attention.py, bench_e2e.py's padding-free mode, bench_decode.py,
bench_prefill.py and bench_variants.py, and run_all.sh's preflight, in subprocesses."""

import csv
import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def run(cmd, tmp_path, **env):
    # A matplotlib that fails to import stands in for one not installed, whatever this
    # environment has.
    blocker = tmp_path / "no_matplotlib" / "matplotlib"
    blocker.mkdir(parents=True, exist_ok=True)
    (blocker / "__init__.py").write_text("raise ImportError('matplotlib blocked by the test')\n")
    env = dict(os.environ, PYTHONPATH=str(blocker.parent), PYTHON=sys.executable, **env)
    return subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_bench_attention_cpu_dry_run_without_matplotlib(tmp_path):
    proc = run([sys.executable, "benchmarks/bench_attention.py", "--quick", "--device", "cpu",
                "--head-dims", "32", "--seqlens", "64", "--causal", "false", "--modes", "fwd",
                "--impls", "ours", "sdpa_math", "--out", str(tmp_path / "out")], tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "DRY RUN on cpu" in output
    assert "attention shapes: 1/1, 0 s elapsed" in output      # the progress line
    assert "ours GFLOP/s" in output and "TFLOP/s" not in output
    assert "plots skipped: matplotlib is not installed" in output
    assert (tmp_path / "out" / "attention_speed.json").is_file()


def test_bench_attention_gqa_cpu_dry_run(tmp_path):
    proc = run([sys.executable, "benchmarks/bench_attention.py", "--device", "cpu", "--head-dims", "32",
                "--seqlens", "64", "--causal", "true", "--modes", "fwd", "bwd", "--kv-group", "2",
                "--impls", "ours", "sdpa_math", "--out", str(tmp_path / "out")], tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    with open(tmp_path / "out" / "attention_speed.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["nheads"], r["nheads_kv"]) for r in rows} == {("4", "2")}
    assert {r["status"] for r in rows} == {"ok"}, rows
    assert "causal=True: ours max|diff| vs SDPA" in output and "ok" in output
    assert "sdpa_math out" in output          # the peer's own output was checked too


def test_bench_check_marks_a_wrong_peer(tmp_path):
    # A peer whose forward is off is marked as failing the check, one that is right passes.
    script = (
        f"import sys, torch, flashattn_ext; sys.path.insert(0, {str(REPO_ROOT / 'benchmarks')!r})\n"
        "import bench_common as bc\n"
        "gen = torch.Generator().manual_seed(0)\n"
        "q, k, v = (torch.randn(1, 64, 2, 32, generator=gen).bfloat16() for _ in range(3))\n"
        "right = bc.build_impls(['sdpa_math'])[0]\n"
        "wrong = bc.AttentionImpl('off_by_v', 'bshd', 'out + 0.5', "
        "lambda q, k, v, c, s: bc._sdpa_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), c, s)"
        ".transpose(1, 2) + 0.5)\n"
        "r = bc.check_ours_against_sdpa(q, k, v, False, 32 ** -0.5, check_backward=False, peers=[right, wrong])\n"
        "print(r.passed, r.peer_passed)\n")
    # cwd: the installed package, not the source tree (no built library there).
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "True {'sdpa_math': True, 'off_by_v': False}", proc.stdout


def test_bench_e2e_packed_cpu_dry_run(tmp_path):
    pytest.importorskip("transformers")
    proc = run([sys.executable, "benchmarks/bench_e2e.py", "--quick", "--device", "cpu",
                "--models", "gpt2_packed", "--impls", "sdpa", "--out", str(tmp_path / "out")], tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "ours packed" in output and "ours padded" in output and "sdpa padded" in output
    assert "check gpt2_packed seq 64: first loss ours packed" in output
    assert "FAILED" not in output
    assert (tmp_path / "out" / "e2e.json").is_file()


def test_run_all_preflight_finds_the_installed_package(tmp_path):
    # No step named "none": the preflight and the summary alone.
    proc = run(["bash", "benchmarks/run_all.sh", str(tmp_path / "out")], tmp_path,
               DEVICE="cpu", RUN_ALL_STEPS="none")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "DRY RUN on cpu" in output
    assert (tmp_path / "out" / "environment.json").read_text().startswith("{")


def test_bench_decode_cpu_dry_run(tmp_path):
    """flash_attn_with_kvcache on contiguous, head-major and paged caches and a peer, each
    checked before it is timed."""
    proc = run([sys.executable, "benchmarks/bench_decode.py", "--quick", "--device", "cpu", "--batches", "2",
                "--kv-lens", "256", "--kv-heads", "2", "--impls", "ours", "sdpa_math", "fa4", "--head-major",
                "--out", str(tmp_path / "out")], tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "check ours b=2 kv=256 hkv=2:" in output and "check ours_paged16 b=2" in output
    assert "check ours_headmajor b=2 kv=256 hkv=2:" in output
    assert "check sdpa_math b=2 kv=256 hkv=2:" in output and "ours / best peer" in output
    assert "FAILED" not in output
    table = (tmp_path / "out" / "decode.csv").read_text()
    assert table.count("ours_paged16") == 1
    assert table.count("ours_headmajor") == 1
    # ours, paged, head-major, sdpa_math, fa4 (a row even where not installed)
    assert table.count("\nbf16,2,256,4,2,32,") == 5


def test_bench_decode_cuda_graph_needs_cuda(tmp_path):
    proc = run([sys.executable, "benchmarks/bench_decode.py", "--quick", "--device", "cpu", "--cuda-graph",
                "--out", str(tmp_path / "out")], tmp_path)
    assert proc.returncode != 0
    assert "--cuda-graph times CUDA-graph replays: it needs --device cuda" in proc.stderr


def test_bench_prefill_cpu_dry_run(tmp_path):
    proc = run([sys.executable, "benchmarks/bench_prefill.py", "--quick", "--device", "cpu",
                "--out", str(tmp_path / "out")], tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "kvcache / dense" in output
    assert (tmp_path / "out" / "prefill.csv").is_file()


def test_bench_variants_cpu_dry_run(tmp_path):
    """Each variant (dropout ones with the mask of tests/dropout_reference.py) checked against
    the fp64 reference before it is timed, its cost against plain in the table and the CSV, and
    the summary against each variant's target; ours timed in every round; fa4 rows for plain and
    softcap even where it is not installed, and for the dropout variants, which it does not have."""
    proc = run([sys.executable, "benchmarks/bench_variants.py", "--device", "cpu", "--impls", "ours", "fa4",
                "--rounds", "2", "--out", str(tmp_path / "out")], tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "DRY RUN on cpu" in output
    variants = ("plain", "softcap", "alibi", "sink", "softcap_alibi_sink", "dropout", "softcap_dropout")
    for variant in variants:
        for causal in (False, True):
            assert f"check {variant} causal={causal}: ok: max |err| vs fp64:" in output
    assert "FAILED" not in output
    assert "[bwd] GFLOP/s, and each modifier's cost against plain in this run (target <= 5 %, with dropout 15 %)" \
        in output
    with open(tmp_path / "out" / "variants.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    ours = [r for r in rows if r["impl"] == "ours"]
    assert len(ours) == len(variants) * 2 * 2  # causal and not, forward and backward
    assert all(r["status"] == "ok" and r["cost_vs_plain"] for r in ours)
    assert all(r["rounds"] == "2" for r in ours)  # each variant timed in both rounds
    fa4 = [r for r in rows if r["impl"] == "fa4"]
    assert sorted(r["variant"] for r in fa4) == (["dropout"] * 4 + ["plain"] * 4 + ["softcap"] * 4
                                                 + ["softcap_dropout"] * 4)
    assert all(r["status"] == "—" and "no dropout" in r["reason"] for r in fa4 if "dropout" in r["variant"])
    summary = json.loads((tmp_path / "out" / "variants.json").read_text())["summary"]
    for mode in ("fwd", "bwd"):
        assert summary[mode]["targets"]["dropout"] == 0.15 and summary[mode]["targets"]["softcap"] == 0.05
        assert summary[mode]["within_target"] == (not summary[mode]["ours_above_target"])


def write_speed_csv(path, cells):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["dtype", "head_dim", "seqlen", "batch", "nheads", "nheads_kv", "causal", "mode", "impl",
                    "status", "reason", "time_ms", "tflops"])
        for d, causal, mode, impl, tflops in cells:
            ok = tflops is not None
            w.writerow(["bf16", d, 8192, 2, 2048 // d, 2048 // d, causal, mode, impl, "ok" if ok else "WRONG",
                        "", 1.0, tflops if ok else ""])


def test_grid_report_merges_runs_and_forms_the_ratios(tmp_path):
    write_speed_csv(tmp_path / "d64.csv", [
        (64, False, "fwd", "ours", 400.0), (64, False, "fwd", "fa4", 500.0), (64, False, "fwd", "sdpa_cudnn", 450.0),
        (64, False, "bwd", "ours", 250.0), (64, False, "bwd", "fa4", 500.0), (64, False, "bwd", "sdpa_cudnn", None)])
    write_speed_csv(tmp_path / "d128.csv", [
        (128, True, "fwd", "ours", 600.0), (128, True, "fwd", "fa4", 500.0)])
    proc = run([sys.executable, "benchmarks/grid_report.py", str(tmp_path / "d64.csv"), str(tmp_path / "d128.csv"),
                "--out", str(tmp_path / "grid.md")], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = (tmp_path / "grid.md").read_text().splitlines()
    assert lines[0] == "| d | heads q/kv | causal | N | mode | ours | fa4 | sdpa_cudnn | ours / best peer |"
    rows = lines[2:]
    assert rows[0] == "| 64 | 32/32 | no | 8192 | fwd | 400 | 500 | 450 | 0.80 |"
    assert rows[1] == "| 64 | 32/32 | no | 8192 | bwd | 250 | 500 | WRONG | 0.50 |"
    # fwd+bwd: 3.5 forward-FLOP units over 1/400 + 2.5/250 of time = 280 for ours, 500 for fa4
    assert rows[2] == "| 64 | 32/32 | no | 8192 | fwd_bwd | 280 | 500 | - | 0.56 |"
    assert rows[3] == "| 128 | 16/16 | yes | 8192 | fwd | 600 | 500 | - | 1.20 |"
    assert len(rows) == 4
    # The same cell from two runs is refused: ratios hold only within one run.
    (tmp_path / "d64_again.csv").write_text((tmp_path / "d64.csv").read_text())
    proc = run([sys.executable, "benchmarks/grid_report.py", str(tmp_path / "d64.csv"),
                str(tmp_path / "d64_again.csv")], tmp_path)
    assert proc.returncode != 0 and "compare only within one run" in proc.stdout + proc.stderr
