"""What the score modifiers and dropout cost: TFLOP/s of ours' forward and backward with
softcap, ALiBi and a learnable sink, each alone and all three together, and with dropout
(alone and with softcap), beside the plain kernel in the same run, and each variant's cost
against plain (the targets, forward and backward: at most 5 % for a score modifier, 15 %
for a variant with dropout, whose Philox draws are real work).

Convention of bench_attention.py: d 128, N 8192, batch * seqlen = 16384 (batch 2), hidden
2048 (16 heads), bf16, causal and not. Every variant is credited with plain attention's
FLOPs (a modifier's elementwise work is not counted), so a TFLOP/s ratio is a time ratio.
Ours is timed through the ops, as bench_attention.py times it: the forward op, and the
backward op alone on a saved out/lse; all variants share the same inputs. Ours is timed in
--rounds rounds (5), each timing every variant in turn; a cost is the median over the rounds
of the ratio within a round, so that the GPU's clock, which drifts between rounds, cancels. Variants: plain;
softcap (--softcap, 30); ALiBi with the standard slopes 2^(-8 (h + 1) / nheads), shape
(nheads,); a learnable sink (fp32 logits around log N, so that the sink takes a visible
share of each row); all three; dropout (--dropout-p, 0.1; one rng_state [seed, offset] for
every call); softcap with dropout.

No speed without a right answer: before it is timed, each variant's out, lse, dq, dk, dv
(and dsink) on the last --check-heads heads of batch 0 (the gentlest ALiBi slopes, where
far keys still count) are held to the test suite's error rule against its fp64 reference
(tests/reference.py; with dropout, the reference applies the mask of tests/dropout_reference.py,
the definition written independently of the kernels); a variant that fails posts no speed
(WRONG, exit status 2).

--impls ours fa4 adds FlashAttention-4 (flash_attn.cute, where it imports; its rows say
"not installed" elsewhere) for plain and softcap, timed as bench_attention.py times the
peers (a training forward; the backward by autograd on a saved graph); its rows give
max_abs_diff_vs_ours, its output's distance from ours on the same inputs. FA4 has no dropout:
its dropout rows say so ("—") and post no speed.

    python benchmarks/bench_variants.py --impls ours fa4 --out results/variants
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import statistics
import sys
from types import SimpleNamespace

import torch

import bench_attention
import bench_common as bc

MODES = ("fwd", "bwd")
# Each variant's modifiers; "plain" first: every other variant's cost is against it.
VARIANTS = {"plain": (), "softcap": ("softcap",), "alibi": ("alibi",), "sink": ("sink",),
            "softcap_alibi_sink": ("softcap", "alibi", "sink"), "dropout": ("dropout",),
            "softcap_dropout": ("softcap", "dropout")}
# The variants FlashAttention-4 runs here: its flash_attn_func takes softcap=.
FA4_VARIANTS = ("plain", "softcap")
FA4_NO_DROPOUT = "FlashAttention-4's flash_attn_func has no dropout"
# Cost against plain, at most: a score modifier's 5 %; dropout's 15 % (a Philox-4x32-7 draw,
# about 30 integer operations, per 16 probabilities, forward and again in the backward).
COST_TARGET = 0.05
DROPOUT_COST_TARGET = 0.15
# The rng_state [seed, offset] of every dropout call (a seed with its high word set).
DROPOUT_RNG_STATE = (0x2545F4914F6CDD1D, 0)


def cost_target(variant: str) -> float:
    """The largest cost against plain that the variant's target allows."""
    return DROPOUT_COST_TARGET if "dropout" in VARIANTS[variant] else COST_TARGET


def targets_text(variants) -> str:
    """'5 %' or '5 %, with dropout 15 %': the targets of the variants in the run."""
    text = f"{100 * COST_TARGET:.0f} %"
    if any("dropout" in VARIANTS[v] for v in variants):
        text += f", with dropout {100 * DROPOUT_COST_TARGET:.0f} %"
    return text


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_common_args(p, default_out="benchmarks/results/variants")
    bc.add_timing_args(p)
    p.add_argument("--head-dim", type=int, default=None, help="128")
    p.add_argument("--seqlen", type=int, default=None, help="8192")
    p.add_argument("--tokens", type=int, default=None, help="batch * seqlen (16384)")
    p.add_argument("--hidden", type=int, default=None, help="nheads * head_dim (2048)")
    p.add_argument("--causal", choices=["both", "true", "false"], default="both")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                   help="plain is always included: the others' costs are against it")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--impls", nargs="+", choices=["ours", "fa4"], default=["ours"],
                   help="fa4 (opt-in): FlashAttention-4 on plain and softcap; ours is always included")
    p.add_argument("--softcap", type=float, default=30.0)
    p.add_argument("--dropout-p", type=float, default=0.1, help="dropout_p of the dropout variants")
    p.add_argument("--check-heads", type=int, default=2,
                   help="heads of batch 0 (the last ones) checked against the fp64 reference")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds of ours' timing, each timing every variant in turn (5; 1 on cpu)")
    return p.parse_args(argv)


def apply_defaults(args, device):
    cpu = device.type == "cpu"
    for name, gpu, dry in (("head_dim", 128, 32), ("seqlen", 8192, 64), ("tokens", 16384, 128),
                           ("hidden", 2048, 64)):
        if getattr(args, name) is None:
            setattr(args, name, dry if cpu else gpu)
    if args.rounds is None:
        args.rounds = 1 if cpu else 5
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    if args.tokens % args.seqlen or args.hidden % args.head_dim:
        raise SystemExit(f"tokens {args.tokens} / seqlen {args.seqlen} or hidden {args.hidden} / "
                         f"head_dim {args.head_dim} is not an integer")
    args.variants = ["plain"] + [v for v in args.variants if v != "plain"]
    if "ours" not in args.impls:
        args.impls = ["ours"] + list(args.impls)
    return args


def load_test_module(name: str):
    """tests/<name>.py, loaded by path (tests/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"flashattn_tests_{name}", bc.REPO_ROOT / "tests" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_test_reference():
    """tests/reference.py: the test suite's reference attention (written from the
    definition, sharing no code with flashattn_ext) and its error rule, with
    tests/dropout_reference.py (the dropout mask from its definition) as its
    ``dropout`` attribute."""
    module = load_test_module("reference")
    module.dropout = load_test_module("dropout_reference")
    return module


def make_modifiers(variant, args, nheads, device, gen) -> SimpleNamespace:
    """softcap, alibi_slopes, learnable_sink, dropout_p and rng_state of a variant (0 / None
    where it has none)."""
    wanted = VARIANTS[variant]
    slopes = torch.exp2(-8.0 * torch.arange(1, nheads + 1, device=device) / nheads)
    # Sink logits around the rows' log-sum-exp (about log N): a sink far below it would
    # take no mass, and a kernel that ignored it would pass the check.
    sink = bc.random_tensor((nheads,), torch.float32, device, gen) + math.log(args.seqlen)
    dropout = "dropout" in wanted
    return SimpleNamespace(softcap=args.softcap if "softcap" in wanted else 0.0,
                           alibi_slopes=slopes if "alibi" in wanted else None,
                           learnable_sink=sink if "sink" in wanted else None,
                           dropout_p=args.dropout_p if dropout else 0.0,
                           rng_state=torch.tensor(DROPOUT_RNG_STATE, dtype=torch.int64, device=device)
                           if dropout else None)


def ours_forward(s, m, scale, causal):
    """The forward op on input set s with modifiers m: (out, lse)."""
    return torch.ops.flashattn_ext.attention_forward(s.q, s.k, s.v, scale, causal, -1, -1, m.softcap,
                                                     m.alibi_slopes, m.dropout_p, m.rng_state,
                                                     learnable_sink=m.learnable_sink)


def ours_backward(s, m, scale, causal):
    """The backward op from s.out, s.lse: (dq, dk, dv, dsink per batch entry)."""
    return torch.ops.flashattn_ext.attention_backward(s.dout, s.q, s.k, s.v, s.out, s.lse, scale, causal, -1, -1,
                                                      m.softcap, m.alibi_slopes, m.dropout_p, m.rng_state, False,
                                                      learnable_sink=m.learnable_sink)


def fa4_forward(softcap):
    """FlashAttention-4's forward with softcap, in bench_common's (q, k, v, causal, scale)
    form (its own fa4 entry takes no modifiers)."""
    def forward(q, k, v, causal, scale):
        from flash_attn.cute import flash_attn_func  # the optional peer: ImportError -> 'not installed'
        out = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, softcap=softcap)
        return out[0] if isinstance(out, tuple) else out
    return forward


def check_ours(s, m, scale, causal, heads, reference):
    """(passed, detail): ours on input set s against the fp64 reference, on the last `heads`
    heads of batch 0 (heads are independent, so a slice of the full run is exact)."""
    s.out, s.lse = ours_forward(s, m, scale, causal)
    dq, dk, dv, dsink = ours_backward(s, m, scale, causal)
    tail = slice(-heads, None)

    def part(t):
        return t[:1, :, tail]

    names = ["out", "lse", "dq", "dk", "dv"]
    actual = [part(s.out), s.lse[:1, tail], part(dq), part(dk), part(dv)]
    if m.learnable_sink is not None:
        names.append(reference.SINK_GRADIENT)
        actual.append(dsink[0, tail])
    kwargs = dict(softmax_scale=scale, causal=causal, softcap=m.softcap,
                  alibi_slopes=None if m.alibi_slopes is None else m.alibi_slopes[tail],
                  learnable_sink=None if m.learnable_sink is None else m.learnable_sink[tail])
    if m.dropout_p > 0:
        # The mask of batch entry 0, heads tail (batch_head = h), from its definition.
        nheads, seqlen_q, seqlen_k = s.q.size(2), s.q.size(1), s.k.size(1)
        seed, offset = DROPOUT_RNG_STATE
        batch_heads = torch.arange(nheads, device=s.q.device)[tail].view(1, -1)
        kwargs.update(dropout_p=m.dropout_p,
                      dropout_mask=reference.dropout.keep_mask(seed, offset, m.dropout_p, batch_heads, seqlen_q,
                                                               seqlen_k, device=s.q.device))
    inputs = [part(t) for t in (s.q, s.k, s.v, s.dout)]
    expected = reference.attention_reference_with_grads(*inputs, **kwargs)
    low_precision = reference.attention_reference_with_grads(*inputs, compute_dtype=s.q.dtype, **kwargs)
    try:
        reference.assert_error_rule(names, actual, expected, low_precision, s.q.dtype, context="ours")
    except AssertionError as exc:
        return False, str(exc)
    errors = ", ".join(f"{n} {reference.max_abs_error(a, e):.2e}" for n, a, e in zip(names, actual, expected))
    return True, f"max |err| vs fp64: {errors}"


def time_ours(sets, m, scale, causal, mode, device, tcfg):
    if mode == "fwd":
        return bc.measure(lambda s: ours_forward(s, m, scale, causal), sets, device, tcfg)
    for s in sets:
        s.out, s.lse = ours_forward(s, m, scale, causal)
    return bc.measure(lambda s: ours_backward(s, m, scale, causal), sets, device, tcfg)


def time_ours_in_rounds(checked, sets, shape, args, device, tcfg, deadline):
    """Ours' rows of the checked variants: each round times every variant and mode in turn,
    and a row's time is the median of its rounds' (each round's the median of its calls).
    Timed one variant after another, the costs moved by the GPU's clock between them: the
    plain forward alone read 598-663 TFLOP/s across runs of one call."""
    round_ms = {(variant, mode): [] for variant in checked for mode in args.modes}
    failures = {}  # (variant, mode) -> the exception that stopped its timing
    for _ in bc.progress(range(args.rounds), desc=f"timing rounds causal={shape.causal}"):
        if deadline.expired():
            break
        for variant, (_, m) in checked.items():
            for mode in args.modes:
                if (variant, mode) in failures:
                    continue
                try:
                    timing = time_ours(sets, m, shape.scale, shape.causal, mode, device, tcfg)
                except bc.RUN_FAILURES as exc:
                    failures[(variant, mode)] = exc
                    continue
                round_ms[(variant, mode)].append(timing.median_ms)
    rows = []
    for (variant, mode), times in round_ms.items():
        row = new_row(checked[variant][0], "ours", mode)
        if (variant, mode) in failures:
            row["status"], row["reason"] = bc.classify_failure(failures[(variant, mode)])
        elif not times:
            row.update(status=bc.STATUS_SKIPPED, reason="time limit")
        else:
            median = statistics.median(times)
            flops = bc.attention_flops(shape.batch, shape.nheads, shape.seqlen, shape.seqlen, shape.head_dim,
                                       shape.causal, mode)
            row.update(time_ms=median, min_ms=min(times), rounds=len(times), round_ms=times,
                       rotation_sets=len(sets), tflops=flops / (median * 1e-3) / 1e12)
        rows.append(row)
    return rows


def fa4_difference(peer, s, m, scale, causal) -> float:
    """max |FA4's out - ours| on input set s: a peer that computes something else posts no
    comparable speed, and its first call compiles its kernel before the timing."""
    with torch.no_grad():
        peer_out = peer.forward(s.q, s.k, s.v, causal, scale)
        ours_out = ours_forward(s, m, scale, causal)[0]
    return (peer_out.float() - ours_out.float()).abs().max().item()


def new_row(base, impl, mode, status=bc.STATUS_OK, reason=""):
    """A row of the CSV, every column present (no time until one is measured)."""
    return dict(base, impl=impl, mode=mode, status=status, reason=reason, time_ms=None, tflops=None)


def timed_row(row, time, flops):
    """row with time()'s median and TFLOP/s, or with the reason it could not run."""
    try:
        timing = time()
        row.update(time_ms=timing.median_ms, min_ms=timing.min_ms, reps=timing.reps,
                   rotation_sets=timing.rotation_sets, tflops=flops / (timing.median_ms * 1e-3) / 1e12)
    except bc.RUN_FAILURES as exc:
        status, reason = bc.classify_failure(exc)
        row.update(status=status, reason=reason)
    return row


def add_costs(rows):
    """cost_vs_plain = time / plain's time - 1, for the same implementation, causal and mode;
    for ours, the median over the rounds of the ratio within each round (a round times every
    variant within seconds, so the GPU's clock drift between rounds cancels)."""
    plain = {(r["impl"], r["causal"], r["mode"]): r for r in rows
             if r["variant"] == "plain" and r["status"] == bc.STATUS_OK}
    for r in rows:
        base = plain.get((r["impl"], r["causal"], r["mode"]))
        if r["status"] != bc.STATUS_OK or base is None:
            continue
        if "round_ms" in r:
            r["cost_vs_plain"] = statistics.median(t / b for t, b in zip(r["round_ms"], base["round_ms"])) - 1
        else:
            r["cost_vs_plain"] = r["time_ms"] / base["time_ms"] - 1


def cost_cell(row):
    if row is None:
        return ""
    if row["status"] != bc.STATUS_OK:
        return row["status"]
    if row["variant"] == "plain":
        return "base"
    return f"{100 * row['cost_vs_plain']:+.1f} %" if "cost_vs_plain" in row else ""


def tables(rows, impls, device):
    """One table per mode: each variant's speed and cost against plain, per implementation."""
    targets = targets_text(dict.fromkeys(r["variant"] for r in rows))
    unit, per_unit = bc.flops_unit(device.type)
    index = {(r["impl"], r["causal"], r["variant"], r["mode"]): r for r in rows}
    out = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        table = []
        keys = list(dict.fromkeys((r["causal"], r["variant"]) for r in rows))
        causals = list(dict.fromkeys(causal for causal, _ in keys))
        keys.sort(key=lambda key: (causals.index(key[0]), list(VARIANTS).index(key[1])))
        for causal, variant in keys:
            line = {"causal": causal, "variant": variant}
            for impl in impls:
                r = index.get((impl, causal, variant, mode))
                speed = "" if r is None else (r["tflops"] * 1e12 / per_unit if r["status"] == bc.STATUS_OK
                                              else r["status"])
                line[f"{impl} {unit}"] = speed
                line[f"{impl} cost"] = cost_cell(r)
            if "fa4" in impls:
                ours, fa4 = index[("ours", causal, variant, mode)], index.get(("fa4", causal, variant, mode))
                line["ours / fa4"] = (bc.ratio_cell(ours["tflops"], fa4["tflops"], fa4["status"], ours["status"])
                                      if fa4 else "")
            table.append(line)
        out.append(bc.format_table(table, title=f"\n[{mode}] {unit}, and each modifier's cost against plain "
                                                f"in this run (target <= {targets})"))
    return "".join(out)


def summarize(rows):
    """Per mode: ours' largest cost against plain and where, each variant's target, the
    variants above theirs, and whether every one meets its target."""
    summary = {}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        costs = [r for r in rows if r["impl"] == "ours" and r["mode"] == mode and "cost_vs_plain" in r
                 and r["variant"] != "plain"]
        worst = max(costs, key=lambda r: r["cost_vs_plain"], default=None)
        above = [r for r in costs if r["cost_vs_plain"] > cost_target(r["variant"])]
        summary[mode] = {"ours_costs": {f"{r['variant']}, causal={r['causal']}": r["cost_vs_plain"] for r in costs},
                         "ours_max_cost": None if worst is None else worst["cost_vs_plain"],
                         "ours_max_cost_at": None if worst is None else f"{worst['variant']}, causal={worst['causal']}",
                         "targets": {v: cost_target(v) for v in dict.fromkeys(r["variant"] for r in costs)},
                         "ours_above_target": [dict(variant=r["variant"], causal=r["causal"],
                                                    cost=r["cost_vs_plain"], target=cost_target(r["variant"]))
                                               for r in above],
                         "within_target": worst is not None and not above}
    return summary


def main(argv=None):
    args, device, dtype, out_dir, tcfg, gen, deadline = bc.start_run(parse_args(argv), apply_defaults)
    reference = load_test_reference()
    batch, nheads, n, d = args.tokens // args.seqlen, args.hidden // args.head_dim, args.seqlen, args.head_dim
    scale = 1.0 / math.sqrt(d)
    fa4 = bc.build_impls(["fa4"])[0] if "fa4" in args.impls else None
    rows, checks = [], []

    def save(final=False, **extra):
        doc = bc.result_document("variants", args, device, rows, checks=checks, complete=final, **extra)
        bc.write_json(doc, out_dir / "variants.json")
        bc.write_csv(rows, out_dir / "variants.csv")

    for causal in bench_attention.causal_values(args.causal):
        # One set of inputs for every variant, so that the variants differ only in their modifiers.
        sets = bc.make_input_sets("bshd", batch, n, n, nheads, nheads, d, dtype, device, gen)
        shape = SimpleNamespace(batch=batch, seqlen=n, nheads=nheads, nheads_kv=nheads, head_dim=d, causal=causal, scale=scale)
        checked = {}  # variant -> (row base, modifiers) of the variants that passed their check
        for variant in bc.progress(args.variants, desc=f"variants causal={causal}"):
            base = dict(dtype=args.dtype, head_dim=d, seqlen=n, batch=batch, nheads=nheads, causal=causal,
                        variant=variant)
            impls = ["ours"] + (["fa4"] if fa4 is not None and variant in FA4_VARIANTS else [])
            if fa4 is not None and "dropout" in VARIANTS[variant]:
                rows += [new_row(base, "fa4", mode, bc.STATUS_UNSUPPORTED, FA4_NO_DROPOUT) for mode in args.modes]
            if deadline.expired():
                rows += [new_row(base, impl, mode, bc.STATUS_SKIPPED, "time limit")
                         for impl in impls for mode in args.modes]
                continue
            m = make_modifiers(variant, args, nheads, device, gen)
            # A broken kernel must not post a speed: check ours first.
            try:
                passed, detail = check_ours(sets[0], m, scale, causal, min(args.check_heads, nheads), reference)
                ours_status = bc.STATUS_OK if passed else bc.STATUS_WRONG
                checks.append(dict(base, passed=passed, detail=detail))
                print(f"check {variant} causal={causal}: {'ok' if passed else 'FAILED'}: {detail}", flush=True)
            except bc.RUN_FAILURES as exc:
                ours_status, detail = bc.classify_failure(exc)
                checks.append(dict(base, passed=None, status=ours_status, error=detail))
                print(f"check {variant} causal={causal}: ours could not run: {detail}", flush=True)
                bc.free_memory(device)
            if ours_status == bc.STATUS_OK:
                checked[variant] = (base, m)
            else:
                rows += [new_row(base, "ours", mode, ours_status, detail) for mode in args.modes]
            if "fa4" in impls:
                peer = dataclasses.replace(fa4, forward=fa4_forward(m.softcap))
                try:
                    difference = fa4_difference(peer, sets[0], m, scale, causal)
                    for mode in args.modes:
                        rows.append(timed_row(
                            dict(new_row(base, "fa4", mode), max_abs_diff_vs_ours=difference),
                            lambda: bench_attention.time_mode(peer, mode, shape, device, dtype, gen, tcfg),
                            bc.attention_flops(batch, nheads, n, n, d, causal, mode)))
                except bc.RUN_FAILURES as exc:
                    status, reason = bc.classify_failure(exc)
                    rows += [new_row(base, "fa4", mode, status, reason) for mode in args.modes]
            bc.free_memory(device)
            save()
        rows += time_ours_in_rounds(checked, sets, shape, args, device, tcfg, deadline)
        save()
        del sets
        bc.free_memory(device)

    add_costs(rows)
    impls = ["ours"] + (["fa4"] if fa4 is not None else [])
    print(tables(rows, impls, device))
    summary = summarize(rows)
    for mode, entry in summary.items():
        if entry["ours_max_cost"] is not None:
            if entry["within_target"]:
                verdict = f"every variant within its target ({targets_text(entry['targets'])})"
            else:
                verdict = "ABOVE the target: " + ", ".join(
                    f"{a['variant']}, causal={a['causal']} {100 * a['cost']:+.1f} % (target {100 * a['target']:.0f} %)"
                    for a in entry["ours_above_target"])
            print(f"{mode}: ours' largest cost against plain {100 * entry['ours_max_cost']:+.1f} % "
                  f"({entry['ours_max_cost_at']}); {verdict}")
    for impl, status, reason in sorted({(r["impl"], r["status"], r["reason"]) for r in rows
                                        if r["status"] not in (bc.STATUS_OK, bc.STATUS_SKIPPED)}):
        print(f"note: {impl} {status}: {reason}")
    save(final=True, summary=summary)
    print(f"wrote {out_dir}/variants.csv and .json")
    return bc.ours_exit_code(rows, checks)


if __name__ == "__main__":
    sys.exit(main())
