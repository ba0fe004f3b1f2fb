"""Variable-length batches: ours (the varlen ops) on one batch of mixed sequence lengths,
against our dense kernel at the batch's mean length, ours on the same sequences in longer
slots cut by seqused (the slack rows NaN, as rows seqused leaves out may be; paged varlen
calls take this route), FlashAttention-4's flash_attn_varlen_func (where flash_attn.cute
imports) and cuDNN through PyTorch's nested-tensor SDPA (where it accepts the case).

Convention (issue 11): lengths drawn uniformly from [--min-len, --max-len] until the batch
holds --total-tokens (the last one trimmed), nheads = hidden / head_dim, bf16. TFLOP/s =
sum over sequences of 4 h d L^2 / t (halved when causal), backward 2.5x the forward;
the dense row uses the same formula on batch = total // mean rows of the mean length.
Each peer's forward output is compared with ours before it is timed.

    python benchmarks/bench_varlen.py --out results/varlen
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import sys
from types import SimpleNamespace

import torch

import bench_common as bc

MODES = ("fwd", "bwd")
IMPLS = ("ours_varlen", "ours_dense_at_mean", "ours_varlen_seqused", "fa4_varlen", "cudnn_nested")
SEQUSED_SLACK = 40  # rows past each sequence's used ones in its slot (not a multiple of a tile)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_common_args(p, default_out="benchmarks/results/varlen")
    bc.add_timing_args(p)
    p.add_argument("--total-tokens", type=int, default=None, help="tokens in the batch (65536)")
    p.add_argument("--min-len", type=int, default=None, help="shortest sequence drawn (512)")
    p.add_argument("--max-len", type=int, default=None, help="longest sequence drawn (8192)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048, help="nheads * head_dim")
    p.add_argument("--causal", choices=["both", "true", "false"], default="both")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    return p.parse_args(argv)


def apply_defaults(args, device):
    cpu = device.type == "cpu"
    for name, gpu, dry in (("total_tokens", 65536, 512), ("min_len", 512, 16), ("max_len", 8192, 128)):
        if getattr(args, name) is None:
            setattr(args, name, dry if cpu else gpu)
    if cpu:
        args.hidden = min(args.hidden, 2 * args.head_dim)
    return args


def draw_lengths(total: int, low: int, high: int, seed: int) -> list[int]:
    """Lengths uniform in [low, high] summing to `total` (the last one trimmed)."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(rng.randint(low, high))
    lengths[-1] -= sum(lengths) - total
    return lengths


def sequence_flops(lengths, nheads, head_dim, causal, mode) -> float:
    return sum(bc.attention_flops(1, nheads, n, n, head_dim, causal, mode) for n in lengths)


def _varlen_inputs(lengths, nheads, head_dim, dtype, device, gen):
    total = sum(lengths)
    t = bc.make_attention_inputs("bshd", 1, total, total, nheads, nheads, head_dim, dtype, device, gen)
    cu = torch.tensor([0] + lengths, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
    return SimpleNamespace(**{k: v[0] for k, v in t.items()}, cu=cu, max_len=max(lengths), used=None)


def _in_slots(s, lengths, slack):
    """The sequences of varlen inputs s in slots `slack` rows longer, the rows past each one NaN,
    called with seqused_q = seqused_k = lengths; used_rows: the slots' rows that hold s's rows."""
    slots = [n + slack for n in lengths]
    starts = [0, *itertools.accumulate(slots)][:-1]
    used_rows = torch.cat([torch.arange(a, a + n) for a, n in zip(starts, lengths)]).to(s.q.device)

    def spread(t):
        out = torch.full((sum(slots), *t.shape[1:]), float("nan"), dtype=t.dtype, device=t.device)
        out[used_rows] = t
        return out

    cu = torch.tensor([0] + slots, dtype=torch.int32, device=s.q.device).cumsum(0, dtype=torch.int32)
    return SimpleNamespace(q=spread(s.q), k=spread(s.k), v=spread(s.v), dout=spread(s.dout), cu=cu,
                           max_len=max(slots), used=torch.tensor(lengths, dtype=torch.int32, device=s.q.device),
                           used_rows=used_rows)


def _ours_varlen_forward(s, scale, causal):
    return torch.ops.flashattn_ext.attention_forward(
        s.q, s.k, s.v, scale, causal, -1, -1, 0.0, None, 0.0, None, False,
        s.cu, s.cu, s.used, s.used, s.max_len, s.max_len)


def _ours_varlen_backward(s, out, lse, scale, causal):
    return torch.ops.flashattn_ext.attention_backward(
        s.dout, s.q, s.k, s.v, out, lse, scale, causal, -1, -1, 0.0, None, 0.0, None, False,
        s.cu, s.cu, s.used, s.used, s.max_len, s.max_len)


def _fa4_varlen():
    from flash_attn.cute import flash_attn_varlen_func  # noqa: F401 (optional peer)
    return flash_attn_varlen_func


def _fa4_forward(fa4, s, scale, causal):
    out = fa4(s.q, s.k, s.v, cu_seqlens_q=s.cu, cu_seqlens_k=s.cu, max_seqlen_q=s.max_len,
              max_seqlen_k=s.max_len, softmax_scale=scale, causal=causal)
    return out[0] if isinstance(out, tuple) else out


def _nested(t, cu):
    """(total, h, d) -> a jagged nested tensor (batch, h, j, d), SDPA's layout."""
    return torch.nested.nested_tensor_from_jagged(t, offsets=cu.long()).transpose(1, 2)


def _cudnn_forward(s, scale, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(
            _nested(s.q, s.cu), _nested(s.k, s.cu), _nested(s.v, s.cu), is_causal=causal, scale=scale)
    return out.transpose(1, 2).values()


def run_point(impl, lengths, causal, args, device, dtype, gen, tcfg, reference):
    """Rows for both modes of one implementation; `reference` holds ours' varlen output."""
    nheads, d = args.hidden // args.head_dim, args.head_dim
    scale = 1.0 / math.sqrt(d)
    mean = round(sum(lengths) / len(lengths))
    base = dict(impl=impl, causal=causal, head_dim=d, nheads=nheads, sequences=len(lengths),
                mean_len=mean, total_tokens=sum(lengths))
    if impl == "ours_dense_at_mean":
        batch = max(1, sum(lengths) // mean)
        sets = bc.make_input_sets("bshd", batch, mean, mean, nheads, nheads, d, dtype, device, gen)
        flops = {m: bc.attention_flops(batch, nheads, mean, mean, d, causal, m) for m in MODES}
        saved = [bc.ours_forward_op(s.q, s.k, s.v, scale, causal) for s in sets]
        fwd = lambda s: bc.ours_forward_op(s.q, s.k, s.v, scale, causal)  # noqa: E731
        bwd = lambda i: bc.ours_backward_op(sets[i].dout, sets[i].q, sets[i].k, sets[i].v,  # noqa: E731
                                            *saved[i], scale, causal)
    else:
        sets = [_varlen_inputs(lengths, nheads, d, dtype, device, gen) for _ in range(2)]
        flops = {m: sequence_flops(lengths, nheads, d, causal, m) for m in MODES}
        if impl.startswith("ours_varlen"):
            if impl == "ours_varlen_seqused":
                # The first set holds the reference's values, so its output is compared with it.
                sets = [_in_slots(s, lengths, SEQUSED_SLACK) for s in (reference[causal][0], sets[1])]
            fwd = lambda s: _ours_varlen_forward(s, scale, causal)  # noqa: E731
            saved = [fwd(s) for s in sets]
            if impl == "ours_varlen":
                reference[causal] = (sets[0], saved[0][0])
            else:
                diff = (saved[0][0][sets[0].used_rows].float() - reference[causal][1].float()).abs().max().item()
                if not diff < 0.05:
                    raise RuntimeError(f"seqused output differs from plain varlen by {diff:.3g}")
                base["max_abs_diff_vs_ours"] = diff
            bwd = lambda i: _ours_varlen_backward(sets[i], *saved[i], scale, causal)  # noqa: E731
        else:
            if impl == "fa4_varlen":
                fa4 = _fa4_varlen()
                fwd = lambda s: _fa4_forward(fa4, s, scale, causal)  # noqa: E731
            else:
                fwd = lambda s: _cudnn_forward(s, scale, causal)  # noqa: E731
            ref_set, ref_out = reference[causal]
            diff = (fwd(ref_set).float() - ref_out.float()).abs().max().item()
            if not diff < 0.05:
                raise RuntimeError(f"output differs from ours by {diff:.3g}")
            base["max_abs_diff_vs_ours"] = diff
            graphs = []
            for s in sets:
                for t in (s.q, s.k, s.v):
                    t.requires_grad_(True)
                graphs.append(fwd(s))
            bwd = lambda i: torch.autograd.grad(graphs[i], (sets[i].q, sets[i].k, sets[i].v),  # noqa: E731
                                                sets[i].dout, retain_graph=True)
    rows = []
    for mode in MODES:
        if mode == "fwd":
            with torch.no_grad():
                timing = bc.measure(fwd, sets, device, tcfg)
        else:
            timing = bc.measure(bwd, list(range(len(sets))), device, tcfg)
        unit, per = bc.flops_unit(device.type)
        rows.append(dict(base, mode=mode, status=bc.STATUS_OK, time_ms=timing.median_ms,
                         tflops=flops[mode] / (timing.median_ms * 1e-3) / per, unit=unit))
    return rows


def main(argv=None):
    args, device, dtype, out_dir, tcfg, gen, _ = bc.start_run(parse_args(argv), apply_defaults)
    lengths = draw_lengths(args.total_tokens, args.min_len, args.max_len, args.seed)
    print(f"{len(lengths)} sequences, {sum(lengths)} tokens, lengths {sorted(lengths)}", flush=True)
    causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    impls = ["ours_varlen"] + [i for i in args.impls if i != "ours_varlen"]
    if device.type == "cpu":
        impls = [i for i in impls if i.startswith("ours")]
    rows, reference = [], {}
    for causal in causals:
        for impl in bc.progress(impls, desc=f"varlen causal={causal}"):
            try:
                rows += run_point(impl, lengths, causal, args, device, dtype, gen, tcfg, reference)
            except Exception as exc:  # a peer that cannot run this case: recorded, not fatal
                if impl.startswith("ours"):
                    raise
                status, reason = bc.classify_failure(exc)
                if status == bc.STATUS_ERROR:
                    status, reason = bc.STATUS_UNSUPPORTED, f"{type(exc).__name__}: {exc}"[:200]
                rows += [dict(impl=impl, causal=causal, mode=m, status=status, reason=reason) for m in MODES]
            bc.free_memory(device)
    for row in rows:
        if row.get("impl", "").startswith("ours_varlen") and row["status"] == bc.STATUS_OK:
            dense = next((r for r in rows if r.get("impl") == "ours_dense_at_mean" and r["causal"] == row["causal"]
                          and r["mode"] == row["mode"] and r["status"] == bc.STATUS_OK), None)
            if dense is not None:
                row["fraction_of_dense"] = row["tflops"] / dense["tflops"]
    bc.write_csv(rows, out_dir / "varlen.csv")
    bc.write_json(dict(lengths=lengths, rows=rows, args=vars(args)), out_dir / "varlen.json")
    print(bc.format_table(rows, ["impl", "causal", "mode", "status", "time_ms", "tflops",
                                 "fraction_of_dense", "max_abs_diff_vs_ours", "reason"],
                          title="variable-length batch"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
