"""Decoding: one query token against a long KV cache (batch 1..64, KV 4k..128k, d 128).

Decoding is bandwidth-bound: every step reads the whole K/V cache once. The figure of
merit is the achieved bandwidth of that read, GB/s = bytes(K) + bytes(V) / time, next to
the copy bandwidth of the same card measured in the same run (a large device-to-device
copy, counting read + write bytes), i.e. what a kernel that only streams memory gets.

Each call is timed eagerly (CUDA events around each call: at batch 1 and a few thousand
keys that is mostly the host's launch time, for every implementation) or, with
--cuda-graph, as replays of a CUDA graph of the calls, as a decoding engine runs its step:
the kernels' own time.

Ours runs flash_attn_with_kvcache (num_splits=0: its own heuristic) on a contiguous cache
("ours") and on paged caches whose pages are scattered by a random block table
("ours_paged<page size>"), and on a cache stored head-major, (batch, KV heads, keys, head_dim) in
memory and passed as its (batch, keys, KV heads, head_dim) view ("ours_headmajor": the
layout the SDPA peers read, and an inference engine's static cache); the peers run on
contiguous K/V in their own layout. Every implementation's output is
checked against an fp32 reference before it is timed (one that fails is not timed), and
the table gives ours (contiguous) over the fastest peer.

    python benchmarks/bench_decode.py --quick --out results/decode
"""

from __future__ import annotations

import argparse
import math
import sys
from types import SimpleNamespace

import torch

import bench_common as bc


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_common_args(p, default_out="benchmarks/results/decode")
    bc.add_timing_args(p)
    p.add_argument("--batches", type=int, nargs="+", default=None)
    p.add_argument("--kv-lens", type=int, nargs="+", default=None)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--nheads", type=int, default=None, help="query heads (16)")
    p.add_argument("--kv-heads", type=int, nargs="+", default=None,
                   help="K/V heads; fewer than --nheads is GQA (16 and 4)")
    p.add_argument("--impls", nargs="+", default=bc.ALL_KERNEL_IMPLS)
    p.add_argument("--copy-mib", type=int, default=None, help="size of the copy-bandwidth buffer")
    p.add_argument("--page-sizes", type=int, nargs="*", default=None,
                   help="paged caches timed for ours besides the contiguous one (64 256)")
    p.add_argument("--head-major", action="store_true",
                   help="also time ours on a head-major cache (the SDPA peers' layout)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="time replays of a CUDA graph of the calls (the kernels' time, as a decoding "
                        "engine replays its step) instead of eager calls (which include the host's "
                        "launch time)")
    p.add_argument("--max-kv-gib", type=float, default=24.0,
                   help="shapes whose K/V would take more are skipped (status 'skipped')")
    return p.parse_args(argv)


def apply_defaults(args, device):
    cpu = device.type == "cpu"
    if cpu and args.cuda_graph:
        raise SystemExit("--cuda-graph times CUDA-graph replays: it needs --device cuda")
    if args.batches is None:
        args.batches = [1, 2] if cpu else [1, 8, 64]
    if args.kv_lens is None:
        args.kv_lens = [256, 1024] if cpu else (
            [4096, 32768, 131072] if args.quick else [4096, 16384, 32768, 65536, 131072])
    args.head_dim = args.head_dim or (32 if cpu else 128)
    args.nheads = args.nheads or (4 if cpu else 32)
    args.kv_heads = args.kv_heads or ([4, 2] if cpu else [32, 8])
    if args.page_sizes is None:
        args.page_sizes = [16] if cpu else [64, 256]
    args.copy_mib = args.copy_mib or (64 if cpu else 2048)
    if "ours" not in args.impls:
        args.impls = ["ours"] + list(args.impls)
    return args


def copy_bandwidth_gbps(device, mib, tcfg):
    """Device-to-device copy of `mib` MiB, counting the bytes read and the bytes written."""
    n = mib * 2 ** 20
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    timing = bc.measure(lambda _: dst.copy_(src), [None], device, tcfg)
    return 2 * n / (timing.median_ms * 1e-3) / 1e9


def make_sets(impl, shape, device, dtype, gen):
    return bc.make_input_sets(impl.layout, shape.batch, 1, shape.kv_len, shape.nheads,
                              shape.nheads_kv, shape.head_dim, dtype, device, gen, with_dout=False)


HEAD_MAJOR = "headmajor"


def as_cache(s, cache, gen):
    """Input set s as flash_attn_with_kvcache's arguments: the contiguous cache itself
    (cache None), the same values stored head-major and passed as a (batch, keys, heads, d)
    view (HEAD_MAJOR), or (cache = a page size) its pages scattered over a pool in a random
    order, with the block table that finds them."""
    batch, kv_len = s.k.shape[:2]
    s.cache_seqlens = torch.full((batch,), kv_len, dtype=torch.int32, device=s.k.device)
    s.block_table = None
    if cache is None:
        s.k_cache, s.v_cache = s.k, s.v
        return s
    if cache == HEAD_MAJOR:
        s.k_cache, s.v_cache = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (s.k, s.v))
        s.k = s.v = None
        return s
    page_size = cache
    pages_per_row = kv_len // page_size
    order = torch.randperm(batch * pages_per_row, generator=gen, device=s.k.device)
    s.block_table = order.view(batch, pages_per_row).to(torch.int32)
    for name in ("k", "v"):
        t = getattr(s, name)
        pool = torch.empty((batch * pages_per_row, page_size) + t.shape[2:], dtype=t.dtype, device=t.device)
        pool[order] = t.reshape((batch * pages_per_row, page_size) + t.shape[2:])
        setattr(s, name + "_cache", pool)
    s.k = s.v = None
    return s


def ours_decode(s, scale):
    import flashattn_ext
    return flashattn_ext.flash_attn_with_kvcache(s.q, s.k_cache, s.v_cache, cache_seqlens=s.cache_seqlens,
                                                 block_table=s.block_table, softmax_scale=scale)


def check_batch_entry_0(out, q, k, v, scale):
    """out (1, h, 1, d) of batch entry 0 against an fp32 reference on q (1, h, 1, d), k, v
    (1, hkv, n, d), within twice the error of the same attention in plain PyTorch in the
    inputs' precision. (max error, allowed, passed)."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))

    def attention(dtype):
        scores = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * scale
        return (scores.softmax(-1) @ v.to(dtype)).float()
    reference = attention(torch.float32)
    plain_err = (attention(q.dtype) - reference).abs().max().item()
    err = (out.float() - reference).abs().max().item()
    allowed = 2 * plain_err + 1e-4
    return err, allowed, err <= allowed


def check_ours(s, scale):
    """Ours on batch entry 0, the keys gathered back through the block table."""
    if s.block_table is None:
        k, v = s.k_cache[:1], s.v_cache[:1]
    else:
        k, v = (c[s.block_table[0].long()].flatten(0, 1)[None] for c in (s.k_cache, s.v_cache))
    out = torch.full_like(s.q[:1], float("nan"))
    out.copy_(ours_decode(s, scale)[:1])
    return check_batch_entry_0(out.transpose(1, 2), s.q[:1].transpose(1, 2), k.transpose(1, 2),
                               v.transpose(1, 2), scale)


def check_peer(impl, s, scale):
    """A peer on batch entry 0 of its own layout's inputs, held to ours' rule: a ratio to a
    peer that answers wrong would mean nothing."""
    with torch.no_grad(), impl.context():
        out = impl.forward(s.q, s.k, s.v, False, scale)[:1]
    to_bhsd = (lambda t: t.transpose(1, 2)) if impl.layout == "bshd" else (lambda t: t)
    return check_batch_entry_0(to_bhsd(out), *(to_bhsd(t[:1]) for t in (s.q, s.k, s.v)), scale)


def time_decode(impl, sets, shape, device, tcfg, cuda_graph):
    scale = shape.scale
    measure = bc.measure_graph_replays if cuda_graph else bc.measure
    with torch.no_grad(), impl.context():
        if impl.is_ours:
            return measure(lambda s: ours_decode(s, scale), sets, device, tcfg)
        return measure(lambda s: impl.forward(s.q, s.k, s.v, False, scale), sets, device, tcfg)


def plot(rows, copy_gbps, out_dir):
    """The paths of the plots written: none without matplotlib."""
    plt = bc.matplotlib_pyplot()
    if plt is None:
        return []
    kv_heads = sorted({r["nheads_kv"] for r in rows}, reverse=True)
    batches = sorted({r["batch"] for r in rows})
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, axes = plt.subplots(len(kv_heads), len(batches), squeeze=False,
                             figsize=(3.8 * len(batches), 3.2 * len(kv_heads)))
    for i, hkv in enumerate(kv_heads):
        for j, b in enumerate(batches):
            ax = axes[i][j]
            plotted = False
            for name in impls:
                pts = sorted((r["kv_len"], r["kv_gbps"]) for r in rows
                             if r["impl"] == name and r["batch"] == b and r["nheads_kv"] == hkv
                             and r["status"] == bc.STATUS_OK)
                bad = sorted({r["status"] for r in rows if r["impl"] == name and r["batch"] == b
                              and r["nheads_kv"] == hkv and r["status"] != bc.STATUS_OK})
                label = name + (f" ({'/'.join(bad)} at {'every' if not pts else 'some'} KV)" if bad else "")
                style = dict(lw=2.5, color="black") if name == "ours" else dict(lw=1.2)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=label,
                        **style)
                plotted = plotted or bool(pts)
            ax.axhline(copy_gbps, ls="--", color="gray", lw=1, label="D2D copy")
            if plotted:   # a log scale needs data (a shape skipped everywhere has none)
                ax.set_xscale("log", base=2)
                ax.xaxis.set_major_formatter(bc.plain_int_formatter())
            ax.set_title(f"batch {b}, kv heads {hkv}", fontsize=9)
            ax.set_xlabel("KV length")
            ax.set_ylabel("GB/s of K/V read")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
    fig.suptitle("Decoding: one query token, bandwidth of the K/V read", fontsize=10)
    fig.tight_layout()
    path = out_dir / "decode_bandwidth.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [str(path)]


def main(argv=None):
    args, device, dtype, out_dir, tcfg, gen, deadline = bc.start_run(parse_args(argv), apply_defaults)
    impls = bc.build_impls(args.impls)

    copy_gbps = copy_bandwidth_gbps(device, args.copy_mib, tcfg)
    bc.free_memory(device)
    print(f"device-to-device copy bandwidth (read + write): {copy_gbps:.0f} GB/s", flush=True)

    shapes = [SimpleNamespace(batch=b, kv_len=n, nheads=args.nheads, nheads_kv=hkv,
                              head_dim=args.head_dim, scale=1.0 / math.sqrt(args.head_dim))
              for hkv in args.kv_heads for b in args.batches for n in args.kv_lens]
    rows, checks = [], []

    def save(final=False, **extra):
        doc = bc.result_document("decode", args, device, rows, checks=checks,
                                 copy_bandwidth_gbps=copy_gbps, complete=final, **extra)
        bc.write_json(doc, out_dir / "decode.json")
        bc.write_csv(rows, out_dir / "decode.csv")

    for shape in bc.progress(shapes, desc="decode shapes"):
        kv_bytes = 2 * shape.batch * shape.kv_len * shape.nheads_kv * shape.head_dim * \
            torch.empty((), dtype=dtype).element_size()
        base = dict(dtype=args.dtype, batch=shape.batch, kv_len=shape.kv_len, nheads=shape.nheads,
                    nheads_kv=shape.nheads_kv, head_dim=shape.head_dim, kv_bytes=kv_bytes)
        if deadline.expired():
            rows += [dict(base, impl=i.name, status=bc.STATUS_SKIPPED, reason="time limit")
                     for i in impls]
            continue
        if kv_bytes > args.max_kv_gib * 2 ** 30:
            rows += [dict(base, impl=i.name, status=bc.STATUS_SKIPPED,
                          reason=f"K/V above --max-kv-gib {args.max_kv_gib}") for i in impls]
            continue
        variants = [(impl, None) for impl in impls]
        variants[1:1] = [(impls[0], page) for page in args.page_sizes if shape.kv_len % page == 0] + \
            [(impls[0], HEAD_MAJOR)] * args.head_major
        for impl, cache in variants:
            name = impl.name if cache is None else impl.name + "_" + (
                cache if cache == HEAD_MAJOR else f"paged{cache}")
            row = dict(base, impl=name, timing="cuda graph" if args.cuda_graph else "eager",
                       status=bc.STATUS_OK, reason="", time_us=None,
                       kv_gbps=None, fraction_of_copy_bw=None)
            try:
                sets = make_sets(impl, shape, device, dtype, gen)
                # A broken kernel must not post a speed: check on the first set.
                if impl.is_ours:
                    sets = [as_cache(s, cache, gen) for s in sets]
                    err, allowed, passed = check_ours(sets[0], shape.scale)
                    checks.append(dict(base, impl=name, passed=passed, ours_err_vs_fp32=err, allowed=allowed))
                else:
                    err, allowed, passed = check_peer(impl, sets[0], shape.scale)
                    row.update(err_vs_fp32=err)
                print(f"check {name} b={shape.batch} kv={shape.kv_len} hkv={shape.nheads_kv}: "
                      f"max err {err:.2e} (allowed {allowed:.2e}) {'ok' if passed else 'FAILED'}", flush=True)
                if not passed:
                    row.update(status=bc.STATUS_WRONG, reason=f"max err {err:.2e} > {allowed:.2e}")
                    raise _NotTimed()
                timing = time_decode(impl, sets, shape, device, tcfg, args.cuda_graph)
                gbps = kv_bytes / (timing.median_ms * 1e-3) / 1e9
                row.update(time_us=timing.median_ms * 1e3, reps=timing.reps,
                           rotation_sets=timing.rotation_sets, kv_gbps=gbps,
                           fraction_of_copy_bw=gbps / copy_gbps)
            except _NotTimed:
                pass
            except bc.RUN_FAILURES as exc:
                row.update(zip(("status", "reason"), bc.classify_failure(exc)))
            sets = None
            bc.free_memory(device)
            rows.append(row)
        save()

    table = []
    for shape_key in dict.fromkeys((r["nheads_kv"], r["batch"], r["kv_len"]) for r in rows):
        hkv, b, n = shape_key
        line = {"kv heads": hkv, "batch": b, "KV": n}
        group = {r["impl"]: r for r in rows if (r["nheads_kv"], r["batch"], r["kv_len"]) == shape_key}
        for name, r in group.items():
            line[f"{name} GB/s"] = r["kv_gbps"] if r["status"] == bc.STATUS_OK else r["status"]
        for name, r in group.items():
            if name.startswith("ours") and r["status"] == bc.STATUS_OK:
                line[f"{name} % of copy"] = f"{100 * r['fraction_of_copy_bw']:.0f}%"
        peers = [r["kv_gbps"] for name, r in group.items() if not name.startswith("ours") and r["status"] == bc.STATUS_OK]
        if peers and group.get("ours", {}).get("status") == bc.STATUS_OK:
            line["ours / best peer"] = f"{group['ours']['kv_gbps'] / max(peers):.2f}"
        table.append(line)
    print(bc.format_table(table, title=f"\nDecoding, d={args.head_dim}, {args.nheads} query heads, "
                          f"{'CUDA-graph replays' if args.cuda_graph else 'eager calls'}; "
                          f"copy bandwidth {copy_gbps:.0f} GB/s"))
    plots = plot(rows, copy_gbps, out_dir)
    ok = [r for r in rows if r["impl"].startswith("ours") and r["status"] == bc.STATUS_OK]
    summary = {"copy_bandwidth_gbps": copy_gbps,
               "ours_max_kv_gbps": max((r["kv_gbps"] for r in ok), default=None),
               "ours_max_fraction_of_copy_bw": max((r["fraction_of_copy_bw"] for r in ok),
                                                   default=None)}
    save(final=True, summary=summary, plots=plots)
    print(f"wrote {out_dir}/decode.csv, .json and {len(plots)} plot(s)")
    return bc.ours_exit_code(rows, checks)


class _NotTimed(Exception):
    """Ours failed its check: recorded as WRONG, no time posted."""


if __name__ == "__main__":
    sys.exit(main())
