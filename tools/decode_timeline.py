"""Where the GPU time of a decoding call goes: its kernels, how long each runs and the gap
before each, for ours (the split model's choice and fixed num_splits) beside cuDNN (through
SDPA), as a decoding engine runs them: replays of a CUDA graph of back-to-back calls.

    python3 tools/decode_timeline.py --batch 1 --kv-len 4096 --kv-heads 8 --num-splits 0 16 32

One query token, 32 query heads (--heads), bf16, a random contiguous (batch, keys, KV heads, d)
cache, cuDNN on the same values stored head-major; the input sets rotate as in
bench_decode.py, so that no call finds its cache in L2. torch.profiler records the GPU
kernels of a few replays (CUPTI's timestamps); they are cut into calls, and each kernel of
a call gets its median duration and its median gap after the end of the kernel before it
(negative: the two overlapped, as a programmatic dependent launch allows). The call's
period (start to start) less the time some kernel of it ran is its idle time: launch gaps
and the tail of one kernel waiting for the next.

(bench_decode.py --cuda-graph and sweep_decode_splits.py give a call's time; this says which
part of it is kernels and which is the gaps between them. RESULTS.md, 2026-12-07.)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_common as bc  # noqa: E402
import bench_decode as bd  # noqa: E402


class Kernel(NamedTuple):
    name: str
    start_us: float
    duration_us: float

    @property
    def end_us(self) -> float:
        return self.start_us + self.duration_us


class KernelSlot(NamedTuple):
    name: str
    duration_us: float  # median over calls
    gap_us: float       # median start minus the end of the kernel before it (of this call or the one before)


class CallTimeline(NamedTuple):
    slots: list[KernelSlot]
    period_us: float  # median start-to-start of consecutive calls
    busy_us: float    # median time some kernel of a call ran (overlaps counted once)
    calls: int        # calls the medians are over
    dropped: int      # kernels not of the calls' pattern (a graph replay's own)

    @property
    def idle_us(self) -> float:
        return self.period_us - self.busy_us


def kernel_events(trace: dict) -> list[Kernel]:
    """The GPU kernels of a Chrome trace (torch.profiler's export_chrome_trace), in start order."""
    kernels = [Kernel(e["name"], float(e["ts"]), float(e["dur"]))
               for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and "dur" in e]
    return sorted(kernels, key=lambda k: k.start_us)


def busy_time(kernels: Sequence[Kernel]) -> float:
    """How long at least one of the kernels ran."""
    total, end = 0.0, float("-inf")
    for k in sorted(kernels, key=lambda k: k.start_us):
        if k.end_us > end:
            total += k.end_us - max(k.start_us, end)
            end = k.end_us
    return total


def call_timeline(kernels: Sequence[Kernel], calls: int) -> CallTimeline:
    """`kernels`: one implementation's kernels over `calls` identical calls. A call's kernels
    are those whose name occurs a whole number of times per call; any other (a replay's own)
    is dropped. Raises ValueError where the rest does not repeat call after call."""
    counts: dict[str, int] = {}
    for k in kernels:
        counts[k.name] = counts.get(k.name, 0) + 1
    kept = [k for k in kernels if counts[k.name] % calls == 0]
    per_call = len(kept) // calls
    if per_call == 0 or any(kept[i].name != kept[i + per_call].name for i in range(len(kept) - per_call)):
        raise ValueError(f"{len(kernels)} kernels do not repeat over {calls} calls: "
                         + ", ".join(f"{name} x{n}" for name, n in counts.items()))
    by_call = [kept[c * per_call:(c + 1) * per_call] for c in range(calls)]
    slots = []
    for j in range(per_call):
        durations = [call[j].duration_us for call in by_call]
        gaps = [call[j].start_us - (call[j - 1] if j > 0 else by_call[c - 1][-1]).end_us
                for c, call in enumerate(by_call) if j > 0 or c > 0]
        slots.append(KernelSlot(kept[j].name, statistics.median(durations),
                                statistics.median(gaps) if gaps else float("nan")))
    periods = [b[0].start_us - a[0].start_us for a, b in zip(by_call, by_call[1:])]
    return CallTimeline(slots, statistics.median(periods) if periods else float("nan"),
                        statistics.median(busy_time(call) for call in by_call), calls, len(kernels) - len(kept))


def short_name(name: str) -> str:
    """A kernel's function name without its namespace, template arguments and parameters."""
    name = name.removeprefix("void ")
    for stop in "<(":
        name = name.split(stop, 1)[0]
    return name.rsplit("::", 1)[-1][:64]


def format_timeline(label: str, timeline: CallTimeline, kv_bytes: int) -> str:
    head = (f"{label}: period {timeline.period_us:7.2f} us ({kv_bytes / timeline.period_us / 1e3:5.0f} GB/s), "
            f"kernels busy {timeline.busy_us:7.2f} us, idle {timeline.idle_us:6.2f} us "
            f"({timeline.calls} calls, {timeline.dropped} other kernels)")
    return "\n".join([head] + [f"    {short_name(s.name):64} {s.duration_us:8.2f} us  gap before {s.gap_us:6.2f} us"
                               for s in timeline.slots])


def profile_replays(fn, sets, device, replays: int) -> CallTimeline:
    """fn's calls as replays of one CUDA graph, under torch.profiler."""
    graph, calls = bc.capture_calls(fn, sets, device, warmup=2)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    return call_timeline(kernel_events(trace), calls * replays)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--kv-len", type=int, default=4096)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--num-splits", type=int, nargs="+", default=[0], help="ours' num_splits (0: its own choice)")
    p.add_argument("--replays", type=int, default=4)
    args = p.parse_args()
    import flashattn_ext

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    shape = SimpleNamespace(batch=args.batch, kv_len=args.kv_len, nheads=args.heads, nheads_kv=args.kv_heads,
                            head_dim=args.head_dim)
    scale = args.head_dim ** -0.5
    (cudnn,) = bc.build_impls(["sdpa_cudnn"])
    ours_impl = SimpleNamespace(layout="bshd")
    sets = [bd.as_cache(s, None, gen) for s in bd.make_sets(ours_impl, shape, device, torch.bfloat16, gen)]
    kv_bytes = 2 * sets[0].k_cache.numel() * sets[0].k_cache.element_size()
    print(f"batch {args.batch}, {args.kv_len} keys, {args.kv_heads} KV heads, {args.heads} query heads, "
          f"d {args.head_dim}, bf16: {kv_bytes / 1e6:.1f} MB of K/V per call, {len(sets)} input sets, "
          f"{torch.cuda.get_device_name(device)}", flush=True)
    with torch.no_grad():
        for splits in args.num_splits:
            timeline = profile_replays(
                lambda s, n=splits: flashattn_ext.flash_attn_with_kvcache(
                    s.q, s.k_cache, s.v_cache, cache_seqlens=s.cache_seqlens, softmax_scale=scale, num_splits=n),
                sets, device, args.replays)
            print(format_timeline(f"ours num_splits={splits}", timeline, kv_bytes), flush=True)
        del sets
        torch.cuda.empty_cache()
        peer_sets = bd.make_sets(cudnn, shape, device, torch.bfloat16, gen)
        with cudnn.context():
            timeline = profile_replays(lambda s: cudnn.forward(s.q, s.k, s.v, False, scale), peer_sets, device,
                                       args.replays)
        print(format_timeline("cuDNN (SDPA)", timeline, kv_bytes), flush=True)


if __name__ == "__main__":
    main()
