#!/usr/bin/env python
"""The main job: attention forward + backward with flashattn_ext on whatever
device is here (CUDA when there is a GPU and this build has its kernels, else
CPU), checked against a float64 reference, then timed against PyTorch's
torch.nn.functional.scaled_dot_product_attention (time and peak memory).

    .venv/bin/python tools/demo.py                 # defaults for the device found
    .venv/bin/python tools/demo.py --seqlen 8192 --no-causal

Check rule (as the tests): max |error| against the float64 reference must be at
most 2x (out) and 3x (dq, dk, dv) the error of SDPA run in the same dtype, with
a floor for fp32 of 1e-4 of the reference's largest magnitude. Exit status 0
when the check passes, 1 otherwise.

Peak memory is the extra memory one forward + backward takes beyond its
inputs: on CUDA torch.cuda.max_memory_allocated, on CPU the process's peak
resident set (VmHWM, reset through /proc/self/clear_refs) over its resident set
before the call.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import flashattn_ext
from flashattn_ext import flash_attn_func


# ---- reference and check --------------------------------------------------------------
def reference_attention(q, k, v, causal):
    """softmax(q kᵀ / sqrt(d)) v from the definition in float64; layout
    (batch, seqlen, nheads, head_dim), causal aligned bottom-right."""
    q, k, v = (t.double() for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        i = torch.arange(sq, device=q.device).view(-1, 1)
        j = torch.arange(sk, device=q.device).view(1, -1)
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    return torch.einsum("bhij,bjhd->bihd", torch.softmax(s, dim=-1), v)


def sdpa(q, k, v, causal):
    """SDPA on the same (batch, seqlen, nheads, head_dim) tensors (it wants heads first)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=causal)
    return out.transpose(1, 2)


def ours(q, k, v, causal):
    return flash_attn_func(q, k, v, causal=causal)


def clear_grads(*tensors):
    for t in tensors:
        t.grad = None


def forward_backward(fn, q, k, v, dout, causal):
    clear_grads(q, k, v)
    out = fn(q, k, v, causal)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def check(device, dtype, batch, seqlen, heads, head_dim, causal):
    """Max |error| of ours and of SDPA against the float64 reference; and the verdict."""
    g = torch.Generator(device="cpu").manual_seed(0)
    shape = (batch, seqlen, heads, head_dim)
    q64, k64, v64, dout64 = (torch.randn(shape, generator=g, dtype=torch.float64).to(device)
                             for _ in range(4))
    ref = [t.clone().requires_grad_() for t in (q64, k64, v64)]
    want = forward_backward(reference_attention, *ref, dout64, causal)
    errors = {}
    for name, fn in (("flashattn_ext", ours), ("sdpa", sdpa)):
        args = [t.to(dtype).requires_grad_() for t in (q64, k64, v64)]
        got = forward_backward(fn, *args, dout64.to(dtype), causal)
        errors[name] = [(a.double() - b).abs().max().item() for a, b in zip(got, want)]
    factors = [2.0, 3.0, 3.0, 3.0]
    floors = [1e-4 * w.abs().max().item() if dtype == torch.float32 else 1e-5 for w in want]
    passed = all(e <= max(f * s, fl) for e, s, f, fl in
                 zip(errors["flashattn_ext"], errors["sdpa"], factors, floors))
    return errors, passed


# ---- timing and memory ------------------------------------------------------------------
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device, iters, warmup):
    for _ in range(warmup):
        fn()
    _sync(device)
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _proc_status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status")


def peak_extra_mib(fn, device):
    """Extra memory of one call of fn beyond what is allocated before it, MiB (None if unknown)."""
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        _sync(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2**20
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)  # hand freed heap back, so that it is not silently reused
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
        base = _proc_status_kib("VmRSS")
        fn()
        return (_proc_status_kib("VmHWM") - base) / 1024
    except OSError:
        return None


def attention_flops(batch, seqlen, heads, head_dim, causal):
    fwd = 4 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)
    return fwd, 3.5 * fwd  # backward = 2.5 x forward


# ---- main -------------------------------------------------------------------------------
def pick_device(requested):
    info = flashattn_ext.build_info()
    if requested == "cpu":
        return torch.device("cpu"), None
    gpu = torch.cuda.is_available()
    if requested == "cuda" or gpu:
        if not gpu:
            sys.exit("demo: --device cuda but torch sees no CUDA device")
        if info["cuda_kernels"] != "yes":
            note = "this build has no CUDA kernels (CPU-only build): running on CPU"
            if requested == "cuda":
                sys.exit(f"demo: {note}")
            return torch.device("cpu"), note
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 0):
            note = f"GPU compute capability {major}.{minor} < 8.0: running on CPU"
            if requested == "cuda":
                sys.exit(f"demo: {note}")
            return torch.device("cpu"), note
        return torch.device("cuda"), None
    return torch.device("cpu"), None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seqlen", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--head-dim", type=int)
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--iters", type=int)
    parser.add_argument("--check-seqlen", type=int,
                        help="sequence length of the float64 check (default: 1024 CUDA, 512 CPU)")
    args = parser.parse_args(argv)

    device, note = pick_device(args.device)
    cuda = device.type == "cuda"
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    batch = args.batch or (4 if cuda else 1)
    seqlen = args.seqlen or (4096 if cuda else 2048)
    heads = args.heads or (16 if cuda else 8)
    head_dim = args.head_dim or (128 if cuda else 64)
    iters = args.iters or (20 if cuda else 3)
    check_seqlen = args.check_seqlen or (1024 if cuda else 512)
    if cuda and dtype == torch.float32:
        sys.exit("demo: the CUDA kernels take bfloat16 and float16; use --dtype bfloat16")

    where = torch.cuda.get_device_name(device) if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(f"flashattn_ext {flashattn_ext.__version__} (torch {torch.__version__}) on {device.type} "
          f"({where})")
    if note:
        print(f"note: {note}")
    print(f"problem: batch {batch}, seqlen {seqlen}, heads {heads}, head_dim {head_dim}, "
          f"{str(dtype).replace('torch.', '')}, {'causal' if args.causal else 'not causal'}")

    # 1. correctness, on a smaller problem so that the float64 reference fits.
    check_batch, check_heads = min(batch, 2), min(heads, 8)
    errors, passed = check(device, dtype, check_batch, check_seqlen, check_heads, head_dim,
                           args.causal)
    print(f"\ncheck against float64 (batch {check_batch}, seqlen {check_seqlen}, heads "
          f"{check_heads}): max |error|")
    print(f"  {'':<16}{'out':>11}{'dq':>11}{'dk':>11}{'dv':>11}")
    for name, errs in errors.items():
        print(f"  {name:<16}" + "".join(f"{e:>11.2e}" for e in errs))
    print(f"  -> {'PASS' if passed else 'FAIL'}: flashattn_ext error <= 2x SDPA's (out), "
          f"3x (grads), same dtype")

    # 2. time and memory on the full problem.
    g = torch.Generator(device="cpu").manual_seed(1)
    shape = (batch, seqlen, heads, head_dim)
    q, k, v, dout = (torch.randn(shape, generator=g).to(device, dtype) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    _, total_flops = attention_flops(batch, seqlen, heads, head_dim, args.causal)
    rows = []
    for name, fn in (("flashattn_ext", ours), ("torch sdpa", sdpa)):
        def fwd():
            with torch.no_grad():
                fn(q, k, v, args.causal)

        def fwd_bwd():
            forward_backward(fn, q, k, v, dout, args.causal)

        try:
            t_fwd = time_ms(fwd, device, iters, warmup=2 if cuda else 1)
            t_all = time_ms(fwd_bwd, device, iters, warmup=2 if cuda else 1)
            # Measured from a state without gradients, so that the fresh dq, dk, dv count.
            clear_grads(q, k, v)
            mem = peak_extra_mib(fwd_bwd, device)
            clear_grads(q, k, v)
            rows.append((name, t_fwd, t_all, total_flops / (t_all * 1e-3) / 1e9, mem))
        except (RuntimeError, NotImplementedError) as e:
            rows.append((name, None, None, None, None))
            print(f"{name}: {type(e).__name__}: {str(e).splitlines()[0]}")
    print(f"\ntime (median of {iters}) and peak extra memory of one forward + backward:")
    print(f"  {'':<16}{'fwd ms':>10}{'fwd+bwd ms':>12}{'TFLOP/s' if cuda else 'GFLOP/s':>10}"
          f"{'peak MiB':>10}")
    for name, t_fwd, t_all, gflops, mem in rows:
        cells = ["n/a" if x is None else f"{x:.2f}" for x in (t_fwd, t_all)]
        rate = "n/a" if gflops is None else f"{gflops / 1e3:.1f}" if cuda else f"{gflops:.1f}"
        cells += [rate, "n/a" if mem is None else f"{mem:.0f}"]
        print(f"  {name:<16}{cells[0]:>10}{cells[1]:>12}{cells[2]:>10}{cells[3]:>10}")
    ok = passed and rows[0][1] is not None
    print(f"\ndemo: {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
