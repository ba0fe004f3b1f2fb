"""Kernel speed: forward, backward and forward+backward of ours against PyTorch SDPA's
backends (flash = FlashAttention-2, cuDNN, memory-efficient, math) and a plain PyTorch
implementation that materialises the N x N scores.

Convention (FlashAttention's benchmarks): batch * seqlen = 16384 tokens, hidden 2048
(nheads = 2048 / headdim), headdim 64/128/256, seqlen 512..16384, causal and not.
TFLOP/s = 4*b*h*N^2*d / t, halved when causal, backward 2.5x the forward.

Backward of ours is the backward op alone on a saved out/lse; the peers' backward is
torch.autograd.grad on a saved graph (their only entry point), fwd+bwd goes through
autograd for everyone (flashattn_ext.flash_attn_func for ours).

    python benchmarks/bench_attention.py --quick --out results/attention
    python benchmarks/bench_attention.py --hidden 4096 --kv-group 4 --head-dims 128   # GQA 32/8
"""

from __future__ import annotations

import argparse
import math
import sys
from types import SimpleNamespace

import torch

import bench_common as bc

MODES = ("fwd", "bwd", "fwd+bwd")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_common_args(p, default_out="benchmarks/results/attention")
    bc.add_timing_args(p)
    p.add_argument("--head-dims", type=int, nargs="+", default=None)
    p.add_argument("--seqlens", type=int, nargs="+", default=None)
    p.add_argument("--causal", choices=["both", "true", "false"], default="both")
    p.add_argument("--modes", nargs="+", choices=MODES, default=None)
    p.add_argument("--impls", nargs="+", default=bc.ALL_KERNEL_IMPLS,
                   help=f"subset of {bc.ALL_KERNEL_IMPLS}, or ours_deterministic (opt-in); ours is always included")
    p.add_argument("--tokens", type=int, default=None, help="batch * seqlen (16384)")
    p.add_argument("--hidden", type=int, default=None, help="nheads * headdim (2048)")
    p.add_argument("--kv-group", type=int, default=1,
                   help="query heads per key/value head (GQA; 1: as many KV heads as query heads)")
    p.add_argument("--check-heads", type=int, default=2,
                   help="heads of batch 0 compared with a float32 reference")
    return p.parse_args(argv)


def apply_defaults(args, device):
    cpu = device.type == "cpu"
    if args.tokens is None:
        args.tokens = 256 if cpu else 16384
    if args.hidden is None:
        args.hidden = 128 if cpu else 2048
    if args.head_dims is None:
        args.head_dims = [32, 64] if cpu else [64, 128, 256]
    if args.seqlens is None:
        if cpu:
            args.seqlens = [64, 128]
        else:
            args.seqlens = [1024, 2048, 4096, 8192] if args.quick else [512, 1024, 2048, 4096, 8192, 16384]
    if args.modes is None:
        args.modes = list(MODES)
    if "ours" not in args.impls:
        args.impls = ["ours"] + list(args.impls)
    return args


def causal_values(choice):
    return {"both": [False, True], "true": [True], "false": [False]}[choice]


def make_sets(impl, shape, device, dtype, gen, *, requires_grad):
    return bc.make_input_sets(impl.layout, shape.batch, shape.seqlen, shape.seqlen, shape.nheads,
                              shape.nheads_kv, shape.head_dim, dtype, device, gen,
                              requires_grad=requires_grad)


def time_mode(impl, mode, shape, device, dtype, gen, tcfg):
    """Median ms of one implementation in one mode; raises on failure (caller classifies)."""
    causal, scale = shape.causal, shape.scale
    if impl.is_flashattn_ext and mode == "fwd":
        sets = make_sets(impl, shape, device, dtype, gen, requires_grad=False)
        return bc.measure(lambda s: bc.ours_forward_op(s.q, s.k, s.v, scale, causal), sets,
                          device, tcfg)
    if impl.is_flashattn_ext and mode == "bwd":
        sets = make_sets(impl, shape, device, dtype, gen, requires_grad=False)
        for s in sets:
            s.out, s.lse = bc.ours_forward_op(s.q, s.k, s.v, scale, causal)
        return bc.measure(lambda s: bc.ours_backward_op(s.dout, s.q, s.k, s.v, s.out, s.lse,
                                                        scale, causal, impl.deterministic), sets, device, tcfg)
    sets = make_sets(impl, shape, device, dtype, gen, requires_grad=True)
    with impl.context():
        if mode == "fwd":
            # A training forward (inputs require grad), as the peers run in a step.
            return bc.measure(lambda s: impl.forward(s.q, s.k, s.v, causal, scale), sets,
                              device, tcfg)
        if mode == "bwd":
            for s in sets:
                s.out = impl.forward(s.q, s.k, s.v, causal, scale)
            return bc.measure(lambda s: torch.autograd.grad(s.out, (s.q, s.k, s.v), s.dout,
                                                            retain_graph=True),
                              sets, device, tcfg)
        return bc.measure(lambda s: torch.autograd.grad(impl.forward(s.q, s.k, s.v, causal, scale),
                                                        (s.q, s.k, s.v), s.dout),
                          sets, device, tcfg)


def run_check(shape, device, dtype, gen, check_heads, need_backward, peers=()):
    t = bc.make_attention_inputs("bshd", shape.batch, shape.seqlen, shape.seqlen, shape.nheads,
                                 shape.nheads_kv, shape.head_dim, dtype, device, gen, with_dout=False)
    result = bc.check_ours_against_sdpa(t["q"], t["k"], t["v"], shape.causal, shape.scale,
                                        check_backward=need_backward, heads=check_heads,
                                        generator=gen, peers=peers)
    del t
    bc.free_memory(device)
    return result


def build_shapes(args):
    shapes = []
    for d in args.head_dims:
        for n in args.seqlens:
            for causal in causal_values(args.causal):
                if args.tokens % n or args.hidden % d or (args.hidden // d) % args.kv_group:
                    raise SystemExit(f"tokens {args.tokens} / seqlen {n}, hidden {args.hidden} / "
                                     f"headdim {d} or nheads / kv_group {args.kv_group} is not an integer")
                shapes.append(SimpleNamespace(head_dim=d, seqlen=n, causal=causal,
                                              batch=args.tokens // n, nheads=args.hidden // d,
                                              nheads_kv=args.hidden // d // args.kv_group,
                                              scale=1.0 / math.sqrt(d)))
    return shapes


def speedup_tables(rows, impls, modes, device):
    """One table per (mode, causal): ours' speed and ours/peer per (headdim, seqlen)."""
    unit, per_unit = bc.flops_unit(device.type)
    peers = [i.name for i in impls if not i.is_ours]
    index = {(r["head_dim"], r["seqlen"], r["causal"], r["mode"], r["impl"]): r for r in rows}
    out = []
    for mode in modes:
        for causal in sorted({r["causal"] for r in rows}):
            table = []
            for d, n in sorted({(r["head_dim"], r["seqlen"]) for r in rows}):
                ours = index.get((d, n, causal, mode, "ours"))
                if ours is None:
                    continue
                line = {"d": d, "N": n, f"ours {unit}": ours["tflops"] * 1e12 / per_unit
                        if ours["status"] == bc.STATUS_OK else ours["status"]}
                for peer in peers:
                    r = index.get((d, n, causal, mode, peer))
                    line[f"vs {peer}"] = (bc.ratio_cell(ours["tflops"], r["tflops"], r["status"],
                                                        ours["status"]) if r else "")
                table.append(line)
            if table:
                out.append(bc.format_table(table, title=f"\n[{mode}, causal={causal}] "
                                           f"ours {unit} and speedup = ours / peer (speed ratio)"))
    return "".join(out)


def plot(rows, impls, modes, out_dir, dtype_name, device):
    """The paths of the plots written: none without matplotlib."""
    plt = bc.matplotlib_pyplot()
    if plt is None:
        return []
    unit, per_unit = bc.flops_unit(device.type)
    paths = []
    for d in sorted({r["head_dim"] for r in rows}):
        causals = sorted({r["causal"] for r in rows if r["head_dim"] == d})
        fig, axes = plt.subplots(len(causals), len(modes), squeeze=False,
                                 figsize=(4.2 * len(modes), 3.3 * len(causals)))
        for i, causal in enumerate(causals):
            for j, mode in enumerate(modes):
                ax = axes[i][j]
                for impl in impls:
                    pts = sorted((r["seqlen"], r["tflops"], r["status"]) for r in rows
                                 if r["head_dim"] == d and r["causal"] == causal
                                 and r["mode"] == mode and r["impl"] == impl.name)
                    good = [(n, t * 1e12 / per_unit) for n, t, s in pts if s == bc.STATUS_OK]
                    bad = sorted({s for _, _, s in pts if s != bc.STATUS_OK})
                    where = "every N" if not good else "some N"
                    label = impl.name + (f" ({'/'.join(bad)} at {where})" if bad else "")
                    style = dict(lw=2.5, color="black") if impl.is_ours else dict(lw=1.2)
                    if good:
                        ax.plot([n for n, _ in good], [t for _, t in good], marker="o", ms=3,
                                label=label, **style)
                    elif pts:
                        ax.plot([], [], label=label, **style)
                ax.set_xscale("log", base=2)
                ax.xaxis.set_major_formatter(bc.plain_int_formatter())
                ax.set_title(f"{mode}, causal={causal}, d={d}", fontsize=9)
                ax.set_xlabel("seqlen")
                ax.set_ylabel(unit)
                ax.grid(alpha=0.3)
                ax.legend(fontsize=6)
        fig.suptitle(f"Attention {dtype_name}, batch*seqlen fixed, headdim {d}", fontsize=10)
        fig.tight_layout()
        path = out_dir / f"attention_speed_d{d}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(str(path))
    return paths


def summarize(rows, impls, modes):
    """Geometric-mean speedup of ours over each peer per mode, over the shapes both ran."""
    index = {(r["head_dim"], r["seqlen"], r["causal"], r["mode"], r["impl"]): r for r in rows}
    summary = {}
    for mode in modes:
        ours_rows = [r for r in rows if r["impl"] == "ours" and r["mode"] == mode]
        entry = {"ours_max_tflops": max((r["tflops"] for r in ours_rows if r["status"] == bc.STATUS_OK),
                                        default=None),
                 "ours_not_ok": sum(r["status"] != bc.STATUS_OK for r in ours_rows)}
        for impl in impls:
            if impl.is_ours:
                continue
            ratios = []
            for r in ours_rows:
                peer = index.get((r["head_dim"], r["seqlen"], r["causal"], mode, impl.name))
                if peer and r["status"] == bc.STATUS_OK and peer["status"] == bc.STATUS_OK:
                    ratios.append(r["tflops"] / peer["tflops"])
            entry[f"geomean_speedup_vs_{impl.name}"] = (
                math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None)
            entry[f"points_vs_{impl.name}"] = len(ratios)
        summary[mode] = entry
    return summary


def main(argv=None):
    args, device, dtype, out_dir, tcfg, gen, deadline = bc.start_run(parse_args(argv), apply_defaults)
    impls = bc.build_impls(args.impls)
    shapes = build_shapes(args)
    rows, checks = [], []
    need_backward = any(m != "fwd" for m in args.modes)
    checked_peers = [i for i in impls if not i.is_flashattn_ext]

    def save(final=False, **extra):
        doc = bc.result_document("attention_speed", args, device, rows, checks=checks,
                                 complete=final, **extra)
        bc.write_json(doc, out_dir / "attention_speed.json")
        bc.write_csv(rows, out_dir / "attention_speed.csv")

    for shape in bc.progress(shapes, desc="attention shapes"):
        base = dict(dtype=args.dtype, head_dim=shape.head_dim, seqlen=shape.seqlen,
                    batch=shape.batch, nheads=shape.nheads, nheads_kv=shape.nheads_kv, causal=shape.causal)
        if deadline.expired():
            rows += [dict(base, mode=m, impl=i.name, status=bc.STATUS_SKIPPED,
                          reason="time limit", time_ms=None, tflops=None)
                     for i in impls for m in args.modes]
            continue
        # A broken kernel must not post a speed: check ours first, once per shape.
        try:
            check = run_check(shape, device, dtype, gen, args.check_heads, need_backward, checked_peers)
            ours_status = bc.STATUS_OK if check.passed else bc.STATUS_WRONG
            ours_reason = "" if check.passed else check.detail
            checks.append(dict(base, passed=check.passed, max_abs_diff_vs_sdpa=check.max_abs_diff_vs_sdpa,
                               ours_err_vs_fp32=check.ours_err_vs_fp32,
                               sdpa_err_vs_fp32=check.sdpa_err_vs_fp32,
                               peer_err_vs_fp32=check.peer_err_vs_fp32, peer_passed=check.peer_passed))
            wrong_peers = {name for name, ok in check.peer_passed.items() if not ok}
            print(f"check d={shape.head_dim} N={shape.seqlen} causal={shape.causal}: ours max|diff| "
                  f"vs SDPA {check.max_abs_diff_vs_sdpa:.2e} ({check.detail}) "
                  f"{'ok' if check.passed else 'FAILED'}", flush=True)
        except bc.RUN_FAILURES as exc:
            ours_status, ours_reason = bc.classify_failure(exc)
            wrong_peers = set()
            checks.append(dict(base, passed=None, status=ours_status, error=ours_reason))
            print(f"check d={shape.head_dim} N={shape.seqlen} causal={shape.causal}: ours could not "
                  f"run: {ours_reason}", flush=True)
            bc.free_memory(device)
        for impl in impls:
            for mode in args.modes:
                row = dict(base, mode=mode, impl=impl.name, status=bc.STATUS_OK, reason="",
                           time_ms=None, tflops=None)
                if impl.is_ours and ours_status != bc.STATUS_OK:
                    row.update(status=ours_status, reason=ours_reason)
                elif impl.name in wrong_peers:
                    row.update(status=bc.STATUS_WRONG, reason="forward output failed the check against fp32")
                else:
                    try:
                        timing = time_mode(impl, mode, shape, device, dtype, gen, tcfg)
                        flops = bc.attention_flops(shape.batch, shape.nheads, shape.seqlen,
                                                   shape.seqlen, shape.head_dim, shape.causal, mode)
                        row.update(time_ms=timing.median_ms, min_ms=timing.min_ms, reps=timing.reps,
                                   rotation_sets=timing.rotation_sets,
                                   tflops=flops / (timing.median_ms * 1e-3) / 1e12)
                    except bc.RUN_FAILURES as exc:
                        status, reason = bc.classify_failure(exc)
                        row.update(status=status, reason=reason)
                        bc.free_memory(device)   # after an OOM, give the next one a clean card
                rows.append(row)
        # The caching allocator reuses the blocks between the modes of one shape; a new
        # shape starts from an empty cache so fragmentation cannot cause a spurious OOM.
        bc.free_memory(device)
        save()

    print(speedup_tables(rows, impls, args.modes, device))
    failed_reasons = {(r["impl"], r["status"], r["reason"]) for r in rows
                      if r["status"] not in (bc.STATUS_OK, bc.STATUS_SKIPPED)}
    for impl, status, reason in sorted(failed_reasons):
        print(f"note: {impl} {status}: {reason}")
    plots = plot(rows, impls, args.modes, out_dir, args.dtype, device)
    summary = summarize(rows, impls, args.modes)
    save(final=True, summary=summary, plots=plots)
    print(f"wrote {out_dir}/attention_speed.csv, .json and {len(plots)} plot(s)")
    return bc.ours_exit_code(rows, checks)


if __name__ == "__main__":
    sys.exit(main())
