"""Where a backward's time goes: each GPU kernel's time per backward call (torch.profiler) beside
the call's wall time (CUDA events) and the last call's kernels on one time axis, for ours and
the peers, at the benchmark convention (bf16, batch * seqlen = 16384, nheads * headdim = 2048).
A dependent launch's kernel time includes its wait for the kernel before it.

    python benchmarks/backward_kernel_times.py --impls ours fa4 sdpa_cudnn \\
        --cases 128:1024 64:1024 128:8192 [--causal]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import bench_common as bc


def kernel_times(impl, head_dim: int, seqlen: int, causal: bool, calls: int):
    heads, batch = 2048 // head_dim, 16384 // seqlen
    shape = (batch, seqlen, heads, head_dim) if impl.layout == "bshd" else (batch, heads, seqlen, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with impl.context():
        out = impl.forward(q, k, v, causal, head_dim ** -0.5)
        grad = torch.randn_like(out)
        backward = lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)  # noqa: E731
        for _ in range(3):
            backward()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                backward()
            torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            backward()
        end.record()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    per_kernel = {}
    for event in kernels:
        per_kernel[event.name[:80]] = per_kernel.get(event.name[:80], 0.0) + event.device_time / calls
    # The last call's kernels on one time axis: where a dependent launch overlaps the one before.
    last_call = kernels[-(len(kernels) // calls):]
    origin = last_call[0].time_range.start
    timeline = [(e.time_range.start - origin, e.time_range.end - origin, e.name[:80]) for e in last_call]
    wall_us = start.elapsed_time(end) * 1000 / calls
    flops = bc.attention_flops(batch, heads, seqlen, seqlen, head_dim, causal, "bwd")
    return wall_us, flops / wall_us / 1e6, per_kernel, timeline


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impls", nargs="+", default=["ours"])
    p.add_argument("--cases", nargs="+", default=["128:1024", "64:1024", "128:8192"], help="head_dim:seqlen")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--calls", type=int, default=10)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("backward_kernel_times.py times GPU kernels: it needs a CUDA device")
    torch.manual_seed(0)
    for impl in bc.build_impls(args.impls):
        for case in args.cases:
            head_dim, seqlen = (int(x) for x in case.split(":"))
            wall_us, tflops, per_kernel, timeline = kernel_times(impl, head_dim, seqlen, args.causal, args.calls)
            print(f"{impl.name} d={head_dim} N={seqlen} causal={args.causal} wall_us={wall_us:.0f} "
                  f"({tflops:.0f} TFLOP/s) kernel_sum_us={sum(per_kernel.values()):.0f}")
            for name, us in sorted(per_kernel.items(), key=lambda item: -item[1])[:6]:
                print(f"   {us:9.1f} us  {name}")
            print("   last call, us from its first kernel's start:")
            for begin, finish, name in timeline:
                print(f"   {begin:9.1f} .. {finish:9.1f}  {name}")


if __name__ == "__main__":
    main()
