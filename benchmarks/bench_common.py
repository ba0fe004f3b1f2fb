"""Shared machinery of the benchmarks: devices, timing, FLOP counts, the attention
implementations compared (ours and its peers), correctness checks and output files.

Every script in benchmarks/ imports this module; nothing here is copied between them.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import datetime
import functools
import gc
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parent.parent
# So that an in-place build (python setup.py build_ext --inplace) of the package is
# importable when a script is run as `python benchmarks/<script>.py` without an install;
# appended, so an installed flashattn_ext (pip install -e) is found first.
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))

# How a result that has no number is shown in tables; the reason goes to the CSV/JSON.
STATUS_OK = "ok"
STATUS_OOM = "OOM"
STATUS_UNSUPPORTED = "—"
STATUS_WRONG = "WRONG"          # failed its correctness check: no speed is posted
STATUS_ERROR = "error"
STATUS_SKIPPED = "skipped"      # not run because the script's time limit was reached

GiB = 1024 ** 3


# --------------------------------------------------------------------------- CLI and device

def add_common_args(parser: argparse.ArgumentParser, *, default_out: str) -> None:
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                        help="auto: cuda when available, else cpu (tiny sizes for dry runs)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--out", default=default_out, help="directory for CSV/JSON/PNG files")
    parser.add_argument("--quick", action="store_true", help="the headline points only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-limit-s", type=float, default=None,
                        help="stop starting new points after this many seconds; the rest are "
                             "recorded as skipped (keeps run_all.sh inside its GPU budget)")


DRY_RUN_NOTE = ("DRY RUN on cpu: tiny sizes that only show the harness works; its speeds and "
                "memory figures say nothing about the kernels (those need --device cuda)")


def resolve_device(name: str) -> torch.device:
    """The device to benchmark on; on the cpu, says once (on stderr) that this is a dry run."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was asked for but torch.cuda.is_available() is False")
    if name == "cpu":
        print(DRY_RUN_NOTE, file=sys.stderr, flush=True)
    return torch.device(name)


def flops_unit(device_type: str) -> tuple[str, float]:
    """(label, FLOP/s per unit) for showing speeds: the cpu's dry-run sizes would print as
    0 TFLOP/s, so GFLOP/s there."""
    return ("TFLOP/s", 1e12) if device_type == "cuda" else ("GFLOP/s", 1e9)


def dtype_from_name(name: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def synchronize(device: torch.device) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if is_cuda(device):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


class Deadline:
    """A soft time limit for a sweep: points past it are recorded as skipped, not run."""

    def __init__(self, limit_s: float | None):
        self.start = time.monotonic()
        self.limit_s = limit_s

    def expired(self) -> bool:
        return self.limit_s is not None and time.monotonic() - self.start > self.limit_s

    def elapsed(self) -> float:
        return time.monotonic() - self.start


class Run(NamedTuple):
    """What every benchmark's main() starts from."""
    args: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    out_dir: Path
    timing: "TimingConfig | None"  # None for a script without the timing arguments
    generator: torch.Generator
    deadline: Deadline


def start_run(args, apply_defaults: Callable[[Any, torch.device], Any]) -> Run:
    """The device (a dry run on the cpu), the script's defaults for it, ours imported and
    checked, the output folder, timing, a seeded generator and the time limit."""
    device = resolve_device(args.device)
    args = apply_defaults(args, device)
    import_ours(device)
    return Run(args, device, dtype_from_name(args.dtype), ensure_out_dir(args.out),
               timing_config_from_args(args, device) if hasattr(args, "budget_ms") else None,
               make_generator(device, args.seed),
               Deadline(args.time_limit_s))


# --------------------------------------------------------------------------- ours

def import_ours(device: torch.device | None = None):
    """Imports flashattn_ext and checks that both ops exist; fails loudly otherwise,
    because a benchmark without ours would only measure the peers."""
    try:
        import flashattn_ext  # noqa: F401
    except Exception as exc:  # ImportError, or a broken build raising OSError
        raise SystemExit(
            f"cannot import flashattn_ext with {sys.executable} ({type(exc).__name__}: {exc}).\n"
            f"Install it first (bash {REPO_ROOT}/tools/setup_env.sh, then run the benchmarks "
            f"with {REPO_ROOT}/.venv/bin/python), or build it in place "
            f"(python setup.py build_ext --inplace in {REPO_ROOT})") from exc
    for op in ("attention_forward", "attention_backward"):
        if not hasattr(torch.ops.flashattn_ext, op):
            raise SystemExit(f"flashattn_ext imported but torch.ops.flashattn_ext.{op} is missing")
    if not hasattr(flashattn_ext, "flash_attn_func"):
        raise SystemExit("flashattn_ext has no flash_attn_func")
    if device is not None and is_cuda(device):
        has_cuda = torch._C._dispatch_has_kernel_for_dispatch_key(
            "flashattn_ext::attention_forward", "CUDA")
        if not has_cuda:
            raise SystemExit("flashattn_ext was built without CUDA kernels; rebuild it on a "
                             "machine with the CUDA toolkit before benchmarking on the GPU")
    return flashattn_ext


def ours_forward_op(q, k, v, scale: float, causal: bool):
    """The forward op alone: (out, lse). Layout (batch, seqlen, nheads, headdim)."""
    return torch.ops.flashattn_ext.attention_forward(q, k, v, scale, causal, -1, -1, 0.0, None,
                                                     0.0, None)


def ours_backward_op(dout, q, k, v, out, lse, scale: float, causal: bool, deterministic: bool = False):
    """The backward op alone, from a saved out/lse, as flash-attn's benchmarks time it."""
    return torch.ops.flashattn_ext.attention_backward(dout, q, k, v, out, lse, scale, causal, -1,
                                                      -1, 0.0, None, 0.0, None, deterministic)


# --------------------------------------------------------------------------- environment

def _command_output(cmd: Sequence[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except Exception:
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


_ENVIRONMENT_CACHE: dict[str, dict[str, Any]] = {}


def environment_info(device: torch.device) -> dict[str, Any]:
    """What RESULTS.md must state beside each table: date, GPU, driver, versions, command.
    Computed once per process (results are saved after every point)."""
    key = str(device)
    if key not in _ENVIRONMENT_CACHE:
        _ENVIRONMENT_CACHE[key] = _environment_info(device)
    return _ENVIRONMENT_CACHE[key]


def _environment_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device": str(device),
        "host_cpu": platform.processor() or platform.machine(),
    }
    try:
        import flashattn_ext
        info["flashattn_ext"] = getattr(flashattn_ext, "__version__", "unknown")
        info["flashattn_ext_file"] = getattr(flashattn_ext, "__file__", None)
        if hasattr(flashattn_ext, "build_info"):
            info["flashattn_ext_build"] = flashattn_ext.build_info()
    except Exception as exc:
        info["flashattn_ext"] = f"not importable: {exc}"
    for mod in ("triton", "transformers"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:
            info[mod] = None
    info["git_commit"] = _command_output(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"])
    if is_cuda(device):
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / GiB, 1),
                    sm_count=props.multi_processor_count,
                    l2_cache_mib=round(l2_cache_bytes(device) / 2 ** 20, 1),
                    shared_memory_per_sm_kib=shared_memory_per_sm_bytes(device) / 1024,
                    compute_capability=f"{props.major}.{props.minor}")
        info["driver"] = _command_output(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return info


def l2_cache_bytes(device: torch.device) -> int:
    if not is_cuda(device):
        return 0  # cpu runs are dry runs: no rotation copies
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 60 * 2 ** 20))


def shared_memory_per_sm_bytes(device: torch.device) -> int:
    """M of the IO-complexity model; 228 KiB on Hopper when torch does not report it."""
    if is_cuda(device):
        props = torch.cuda.get_device_properties(device)
        for name in ("shared_memory_per_multiprocessor", "max_shared_memory_per_multiprocessor"):
            value = getattr(props, name, None)
            if value:
                return int(value)
    return 228 * 1024


# --------------------------------------------------------------------------- timing

@dataclasses.dataclass
class Timing:
    median_ms: float
    min_ms: float
    reps: int
    rotation_sets: int


def rotation_set_count(bytes_per_set: int, device: torch.device, max_sets: int = 64) -> int:
    """How many input sets to cycle through so that a timed call never finds its inputs
    left in L2 by the previous call. A set larger than 3x L2 cannot stay resident, so one
    set is enough and large shapes do not pay the memory of copies."""
    cover = 3 * l2_cache_bytes(device)
    if bytes_per_set >= cover:
        return 1
    return max(2, min(max_sets, math.ceil(cover / max(bytes_per_set, 1)) + 1))


@dataclasses.dataclass
class TimingConfig:
    warmup: int = 2
    min_reps: int = 5
    max_reps: int = 50
    budget_ms: float = 150.0   # timed GPU time per measurement, approximately


def add_timing_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--warmup", type=int, default=None, help="warm-up calls (2; 1 on cpu)")
    parser.add_argument("--min-reps", type=int, default=None, help="at least this many timed calls")
    parser.add_argument("--max-reps", type=int, default=None, help="at most this many timed calls")
    parser.add_argument("--budget-ms", type=float, default=None,
                        help="approximate timed time per measurement: reps = budget / time "
                             "of one call, clamped to [min-reps, max-reps] (150 ms on cuda)")


def timing_config_from_args(args, device: torch.device) -> TimingConfig:
    # On cpu the numbers only prove the harness runs, so keep dry runs short.
    default = TimingConfig() if is_cuda(device) else TimingConfig(1, 2, 3, 10.0)
    return TimingConfig(
        default.warmup if args.warmup is None else args.warmup,
        default.min_reps if args.min_reps is None else args.min_reps,
        default.max_reps if args.max_reps is None else args.max_reps,
        default.budget_ms if args.budget_ms is None else args.budget_ms)


def measure(fn: Callable[[Any], Any], sets: Sequence[Any], device: torch.device,
            cfg: TimingConfig) -> Timing:
    """Median time of fn(set) over reps, cycling through `sets`.

    On CUDA each call is bracketed by CUDA events (no host sync inside the loop, so launch
    latency overlaps with the previous call as in a real step); the number of reps is chosen
    from the last warm-up call so a slow shape does not run for minutes.
    """
    n = len(sets)
    for i in range(max(cfg.warmup, 1)):
        if is_cuda(device):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(sets[i % n])
            end.record()
        else:
            t0 = time.perf_counter()
            fn(sets[i % n])
            t_est = (time.perf_counter() - t0) * 1e3
    if is_cuda(device):
        end.synchronize()
        t_est = start.elapsed_time(end)
    reps = _reps(cfg, t_est)
    times: list[float] = []
    if is_cuda(device):
        times = _cuda_event_times(lambda i: fn(sets[i % n]), reps, device)
    else:
        for i in range(reps):
            t0 = time.perf_counter()
            fn(sets[i % n])
            times.append((time.perf_counter() - t0) * 1e3)
    return Timing(statistics.median(times), min(times), reps, n)


def measure_graph_replays(fn: Callable[[Any], Any], sets: Sequence[Any], device: torch.device,
                          cfg: TimingConfig) -> Timing:
    """Median GPU time of fn(set), from replays of one CUDA graph that calls fn on each set
    in turn.

    What a decoding engine sees (it replays its step as a graph): the kernels back to back,
    without the host's launch and dispatch time, which at a few tens of microseconds per
    call is longer than the kernels of a small decode and would otherwise be what `measure`
    times. CUDA only; fn must be capturable.
    """
    if not is_cuda(device):
        raise NotImplementedError("CUDA-graph timing needs a CUDA device")
    graph, calls = capture_calls(fn, sets, device, cfg.warmup)
    reps = _reps(cfg, _cuda_event_times(lambda _: graph.replay(), 1, device)[0])
    times = [t / calls for t in _cuda_event_times(lambda _: graph.replay(), reps, device)]
    del graph
    return Timing(statistics.median(times), min(times), reps, len(sets))


def capture_calls(fn: Callable[[Any], Any], sets: Sequence[Any], device: torch.device, warmup: int,
                  min_calls: int = 16) -> tuple[torch.cuda.CUDAGraph, int]:
    """A CUDA graph of fn(set) on each set in turn, at least min_calls calls (whole rounds
    of the sets), after `warmup` eager calls, and replayed once; returns it and its calls.

    At least 16 calls per graph: a replay's own start (several microseconds) must not weigh
    on a call of a hundred."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
        for i in range(max(warmup, 1)):
            fn(sets[i % len(sets)])
    torch.cuda.current_stream(device).wait_stream(side)
    calls = len(sets) * math.ceil(min_calls / len(sets))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(sets[i % len(sets)])
    graph.replay()
    return graph, calls


def _reps(cfg: TimingConfig, t_est_ms: float) -> int:
    """Timed calls for a measurement: about cfg.budget_ms of them, within [min_reps, max_reps]."""
    return int(min(cfg.max_reps, max(cfg.min_reps, cfg.budget_ms / max(t_est_ms, 1e-3))))


def _cuda_event_times(step: Callable[[int], Any], reps: int, device: torch.device) -> list[float]:
    """step(i) for i < reps, each between two CUDA events, with no host sync in between; ms each."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for i, (start, end) in enumerate(events):
        start.record()
        step(i)
        end.record()
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) for s, e in events]


def classify_failure(exc: BaseException) -> tuple[str, str]:
    """(status, reason) for an exception raised by one implementation on one shape.
    Only failures that mean "this implementation can't run this shape" are caught by the
    callers; programming errors (TypeError, AttributeError...) propagate and stop the run."""
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
        return STATUS_OOM, "out of memory"
    if isinstance(exc, ImportError):
        return STATUS_UNSUPPORTED, f"not installed: {exc}"[:300]
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    lowered = str(exc).lower()
    if isinstance(exc, NotImplementedError) or any(
            m in lowered for m in ("no available kernel", "no viable backend", "not supported",
                                   "unsupported", "not_supported")):
        return STATUS_UNSUPPORTED, text[:300]
    return STATUS_ERROR, f"{type(exc).__name__}: {text[:300]}"


# Exceptions that mean "cannot run this shape" rather than "the benchmark is broken".
RUN_FAILURES = (torch.OutOfMemoryError, RuntimeError, NotImplementedError, ValueError, ImportError)


# --------------------------------------------------------------------------- FLOPs

def attention_flops(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                    causal: bool, mode: str) -> float:
    """The FlashAttention convention: 4*b*h*Nq*Nk*d for the forward (two matmuls), halved
    when causal; the backward is 2.5x the forward (five matmuls); fwd+bwd 3.5x."""
    fwd = 4.0 * batch * nheads * seqlen_q * seqlen_k * head_dim
    if causal:
        fwd /= 2
    return fwd * {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[mode]


# --------------------------------------------------------------------------- implementations

def materialized_attention(q, k, v, causal: bool, scale: float):
    """Standard attention as a user would write it in PyTorch: S = QK^T, P = softmax(S),
    O = PV, each an N x N tensor in HBM (softmax in the input dtype, as in HF GPT-2 eager).
    Layout (batch, nheads, seqlen, headdim); k/v may have fewer heads (GQA), which is
    handled by grouping the query heads instead of copying K/V."""
    b, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = h // hkv
    qg = q.reshape(b, hkv, group * sq, d) if group > 1 else q
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale
    if group > 1:
        scores = scores.reshape(b, h, sq, sk)
    if causal:
        # Bottom-right aligned like flash-attn 2.1+: query i sees keys j <= i + (sk - sq).
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if group > 1:
        probs = probs.reshape(b, hkv, group * sq, sk)
    out = torch.matmul(probs, v)
    return out.reshape(b, h, sq, d) if group > 1 else out


def reference_attention_fp32(q, k, v, causal: bool, scale: float):
    """float32 ground truth for the checks; layout (batch, nheads, seqlen, headdim)."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    return materialized_attention(q.float(), k, v, causal, scale)


SDPA_BACKENDS = {
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
    "sdpa_math": "MATH",
}


@dataclasses.dataclass
class AttentionImpl:
    """One implementation under test.

    layout "bshd" = (batch, seqlen, nheads, headdim) (ours, flash-attn); "bhsd" =
    (batch, nheads, seqlen, headdim) (SDPA and the materialised one). Each gets its inputs
    generated contiguous in its own layout, so no one pays for a transpose in the timing.
    """
    name: str
    layout: str
    description: str
    forward: Callable[..., Any]          # (q, k, v, causal, scale) -> out, autograd-aware
    context: Callable[[], Any] = contextlib.nullcontext
    deterministic: bool = False          # ours only: the fixed-order dq reduction

    @property
    def is_ours(self) -> bool:
        return self.name == "ours"

    @property
    def is_flashattn_ext(self) -> bool:
        """Ours in either dq mode: timed through the ops directly."""
        return self.name in ("ours", "ours_deterministic")


def _sdpa_context(backend_name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    @contextlib.contextmanager
    def ctx():
        with warnings.catch_warnings():
            # SDPA warns before raising "No available kernel"; the table says it instead.
            warnings.simplefilter("ignore")
            with sdpa_kernel(backend):
                yield
    return ctx


def _sdpa_forward(q, k, v, causal: bool, scale: float):
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    # SDPA's is_causal is top-left aligned; only equal lengths are benchmarked with causal.
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, **gqa)


def _ours_autograd_forward(q, k, v, causal: bool, scale: float, deterministic: bool = False):
    import flashattn_ext
    return flashattn_ext.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, deterministic=deterministic)


def _fa4_forward(q, k, v, causal: bool, scale: float):
    # Optional peer, not a dependency: ../shared/tools/fa4_wheels.sh installs it on the GPU machine.
    from flash_attn.cute import flash_attn_func
    out = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)
    return out[0] if isinstance(out, tuple) else out


def build_impls(names: Iterable[str]) -> list[AttentionImpl]:
    registry = {
        "ours": lambda: AttentionImpl("ours", "bshd", "flashattn_ext (this repo)",
                                      _ours_autograd_forward),
        # Opt-in (not in ALL_KERNEL_IMPLS): the price of a fixed dq reduction order.
        "ours_deterministic": lambda: AttentionImpl(
            "ours_deterministic", "bshd", "flashattn_ext, deterministic=True",
            functools.partial(_ours_autograd_forward, deterministic=True), deterministic=True),
        "materialized": lambda: AttentionImpl(
            "materialized", "bhsd", "plain PyTorch: S=QK^T, softmax, PV in HBM",
            materialized_attention),
        # Opt-in: FlashAttention-4 (flash-attn-4's CuTe-DSL kernels), where it is installed.
        "fa4": lambda: AttentionImpl("fa4", "bshd", "FlashAttention-4 (flash_attn.cute)", _fa4_forward),
    }
    for name, backend in SDPA_BACKENDS.items():
        registry[name] = (lambda n=name, b=backend: AttentionImpl(
            n, "bhsd", f"torch SDPA, SDPBackend.{b}", _sdpa_forward, _sdpa_context(b)))
    impls = []
    for name in names:
        if name not in registry:
            raise SystemExit(f"unknown implementation {name!r}; known: {sorted(registry)}")
        impls.append(registry[name]())
    return impls


ALL_KERNEL_IMPLS = ["ours", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math",
                    "materialized"]


# --------------------------------------------------------------------------- inputs

def random_tensor(shape, dtype, device, generator, requires_grad=False) -> torch.Tensor:
    """Random normal values, never zeros: zeros would let a kernel skip work or hide
    uninitialised memory."""
    t = torch.randn(shape, dtype=torch.float32 if device.type == "cpu" else dtype,
                    device=device, generator=generator).to(dtype)
    return t.requires_grad_(requires_grad)


def make_attention_inputs(layout: str, batch: int, seqlen_q: int, seqlen_k: int, nheads: int,
                          nheads_kv: int, head_dim: int, dtype, device, generator,
                          requires_grad=False, with_dout=True) -> dict[str, torch.Tensor]:
    def shape(s, h):
        return (batch, s, h, head_dim) if layout == "bshd" else (batch, h, s, head_dim)
    t = {"q": random_tensor(shape(seqlen_q, nheads), dtype, device, generator, requires_grad),
         "k": random_tensor(shape(seqlen_k, nheads_kv), dtype, device, generator, requires_grad),
         "v": random_tensor(shape(seqlen_k, nheads_kv), dtype, device, generator, requires_grad)}
    if with_dout:
        t["dout"] = random_tensor(shape(seqlen_q, nheads), dtype, device, generator)
    return t


def make_input_sets(layout: str, batch: int, seqlen_q: int, seqlen_k: int, nheads: int,
                    nheads_kv: int, head_dim: int, dtype, device, generator, *,
                    requires_grad=False, with_dout=True) -> list[SimpleNamespace]:
    """Input sets (q, k, v[, dout] as attributes) in one layout, as many as
    rotation_set_count() asks for, so timed calls cycle through them and never find their
    inputs in L2."""
    def one():
        return SimpleNamespace(**make_attention_inputs(
            layout, batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, dtype, device,
            generator, requires_grad=requires_grad, with_dout=with_dout))
    first = one()
    n = rotation_set_count(tensor_bytes(vars(first).values()), device)
    return [first] + [one() for _ in range(n - 1)]


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def make_generator(device: torch.device, seed: int) -> torch.Generator:
    gen = torch.Generator(device=device if is_cuda(device) else "cpu")
    gen.manual_seed(seed)
    return gen


# --------------------------------------------------------------------------- memory

class SavedTensorsMeter:
    """Sums the bytes autograd saves for backward inside the `with` block, once per
    storage (several nodes saving views of one tensor count once). Storages of the given
    inputs are counted apart: they exist anyway, the rest is activation memory that the
    implementation chose to keep."""

    def __init__(self, inputs: Iterable[torch.Tensor] = ()):
        self.input_storages = {t.untyped_storage().data_ptr() for t in inputs}
        self.storages: dict[int, int] = {}

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)

    @property
    def total_bytes(self) -> int:
        return sum(self.storages.values())

    @property
    def activation_bytes(self) -> int:
        return sum(n for ptr, n in self.storages.items() if ptr not in self.input_storages)


def peak_memory_of(fn: Callable[[], Any], device: torch.device) -> int | None:
    """Peak bytes allocated while fn() runs, above what was allocated before it (the
    inputs); None on cpu, where torch keeps no allocator statistics."""
    if not is_cuda(device):
        fn()
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def fwd_bwd_memory(impl: AttentionImpl, tensors: dict[str, torch.Tensor], causal: bool,
                   scale: float, device: torch.device, forward=None) -> dict[str, Any]:
    """One forward + backward of `impl` (autograd) on tensors q, k, v (requiring grad) and
    dout: peak memory above the inputs, and the bytes saved for backward."""
    q, k, v, dout = tensors["q"], tensors["k"], tensors["v"], tensors["dout"]
    forward = forward or impl.forward
    meter = SavedTensorsMeter([q, k, v])

    def step():
        with impl.context():
            with meter:
                out = forward(q, k, v, causal, scale)
            grads = torch.autograd.grad(out, (q, k, v), dout)
        del out, grads
    peak = peak_memory_of(step, device)
    return {"peak_bytes": peak, "saved_bytes": meter.total_bytes,
            "saved_activation_bytes": meter.activation_bytes}


# --------------------------------------------------------------------------- correctness

@dataclasses.dataclass
class CheckResult:
    passed: bool
    max_abs_diff_vs_sdpa: float
    ours_err_vs_fp32: dict[str, float]
    sdpa_err_vs_fp32: dict[str, float]
    detail: str
    # Per peer (the impls given as `peers`): its forward's error against the fp32 reference,
    # or the failure it raised, and whether it passed the same criterion as ours.
    peer_err_vs_fp32: dict[str, float] = dataclasses.field(default_factory=dict)
    peer_passed: dict[str, bool] = dataclasses.field(default_factory=dict)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def check_ours_against_sdpa(q, k, v, causal: bool, scale: float, *, check_backward: bool,
                            heads: int = 2, generator=None, peers: Sequence["AttentionImpl"] = ()) -> CheckResult:
    """Runs ours once on the full inputs (layout bshd) and compares with SDPA's default
    dispatch on the same values, and both with a float32 reference on the first `heads`
    heads of batch 0 (heads are independent, so a slice of the full run is exact).

    Passes when ours' error against fp32 is at most 3x SDPA's plus a small floor
    (flash-attn's own test criterion, with margin): a broken kernel is off by O(1) of the
    output scale and fails by orders of magnitude. Each of `peers` runs its forward on the same
    values and is held to the same criterion on `out` (a peer that fails it is not timed).
    """
    group = q.shape[2] // k.shape[2]
    heads = max(1, min(heads, k.shape[2])) * group   # whole GQA groups
    heads_kv = heads // group
    qs, ks, vs = q.detach(), k.detach(), v.detach()
    dout = random_tensor(q.shape, q.dtype, q.device, generator) if check_backward else None

    out, lse = ours_forward_op(qs, ks, vs, scale, causal)
    qb, kb, vb = (t.transpose(1, 2) for t in (qs, ks, vs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sdpa_out = _sdpa_forward(qb, kb, vb, causal, scale).transpose(1, 2)
    diff_vs_sdpa = _max_abs(out, sdpa_out)

    def fp32_slice(t, nh):
        return t[:1, :, :nh].float().transpose(1, 2).detach().requires_grad_(check_backward)
    rq, rk, rv = fp32_slice(qs, heads), fp32_slice(ks, heads_kv), fp32_slice(vs, heads_kv)
    with torch.enable_grad():
        ref = reference_attention_fp32(rq, rk, rv, causal, scale)
    ours_err = {"out": _max_abs(out[:1, :, :heads].transpose(1, 2), ref)}
    sdpa_err = {"out": _max_abs(sdpa_out[:1, :, :heads].transpose(1, 2), ref)}
    scale_of = {"out": ref.abs().max().item()}

    if check_backward:
        dq, dk, dv, _ = ours_backward_op(dout, qs, ks, vs, out, lse, scale, causal)
        dout_b = dout.transpose(1, 2)
        with torch.enable_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qg, kg, vg = (t.detach().requires_grad_() for t in (qb, kb, vb))
            s_dq, s_dk, s_dv = torch.autograd.grad(_sdpa_forward(qg, kg, vg, causal, scale),
                                                   (qg, kg, vg), dout_b)
            r_dq, r_dk, r_dv = torch.autograd.grad(ref, (rq, rk, rv),
                                                   fp32_slice(dout, heads).detach())
        for name, mine, theirs, truth, nh in (("dq", dq, s_dq.transpose(1, 2), r_dq, heads),
                                             ("dk", dk, s_dk.transpose(1, 2), r_dk, heads_kv),
                                             ("dv", dv, s_dv.transpose(1, 2), r_dv, heads_kv)):
            ours_err[name] = _max_abs(mine[:1, :, :nh].transpose(1, 2), truth)
            sdpa_err[name] = _max_abs(theirs[:1, :, :nh].transpose(1, 2), truth)
            scale_of[name] = truth.abs().max().item()

    def within(err, name):
        return err <= 3.0 * sdpa_err[name] + 1e-3 * max(scale_of[name], 1e-6)

    peer_err, peer_passed = {}, {}
    for peer in peers:
        inputs = (qs, ks, vs) if peer.layout == "bshd" else (qb.contiguous(), kb.contiguous(), vb.contiguous())
        try:
            with torch.no_grad(), peer.context(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                peer_out = peer.forward(*inputs, causal, scale)
        except RUN_FAILURES:
            continue  # its timing meets the same failure and reports it
        if peer.layout != "bshd":
            peer_out = peer_out.transpose(1, 2)
        peer_err[peer.name] = _max_abs(peer_out[:1, :, :heads].transpose(1, 2), ref)
        peer_passed[peer.name] = within(peer_err[peer.name], "out")
        del peer_out

    bad = [n for n in ours_err if not within(ours_err[n], n)]
    detail = ", ".join(f"{n}: ours {ours_err[n]:.2e} sdpa {sdpa_err[n]:.2e}" for n in ours_err)
    detail += "".join(f", {name} out {err:.2e}{'' if peer_passed[name] else ' WRONG'}"
                      for name, err in peer_err.items())
    return CheckResult(not bad, diff_vs_sdpa, ours_err, sdpa_err,
                       ("FAILED on " + ",".join(bad) + "; " if bad else "") + detail, peer_err, peer_passed)


def ours_exit_code(rows: Sequence[dict[str, Any]], checks: Sequence[dict[str, Any]] = ()) -> int:
    """Non-zero when ours gave a wrong answer (2) or raised an error (3) anywhere; OOM and
    unsupported are not failures (the tables show them). run_all.sh reports the code."""
    if any(c.get("passed") is False for c in checks):
        print("ERROR: ours failed a correctness check (see the 'check' lines)", file=sys.stderr)
        return 2
    if any(r.get("impl") == "ours" and r.get("status") == STATUS_ERROR for r in rows):
        print("ERROR: ours raised an error on some point (see the notes / CSV reason column)",
              file=sys.stderr)
        return 3
    return 0


# --------------------------------------------------------------------------- outputs

def ensure_out_dir(path: str | os.PathLike) -> Path:
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> None:
    columns: list[str] = []
    for row in rows:
        for key in row:
            if key not in columns:
                columns.append(key)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_value(row.get(k)) for k in columns})


def _csv_value(value):
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else value


def write_json(obj: Any, path: Path) -> None:
    def default(o):
        if dataclasses.is_dataclass(o):
            return dataclasses.asdict(o)
        if isinstance(o, (torch.dtype, torch.device, Path)):
            return str(o)
        raise TypeError(f"not JSON serialisable: {type(o)}")
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=default, allow_nan=True)
    os.replace(tmp, path)   # a killed run never leaves a half-written JSON


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None,
                 title: str | None = None) -> str:
    if not rows:
        return (title + "\n" if title else "") + "(no rows)\n"
    columns = list(columns or rows[0].keys())
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = [title] if title else []
    lines.append("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines) + "\n"


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def ratio_cell(ours: float | None, peer: float | None, peer_status: str,
               ours_status: str = STATUS_OK) -> str:
    """'1.23x' when both ran; otherwise the reason one of them has no number."""
    if ours_status != STATUS_OK:
        return f"ours {ours_status}"
    if peer_status != STATUS_OK:
        return peer_status
    return f"{ours / peer:.2f}x"


def human_bytes(n: float | None) -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "n/a"
    for unit, div in (("GiB", GiB), ("MiB", 2 ** 20), ("KiB", 1024)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def result_document(kind: str, args, device, rows, **extra) -> dict[str, Any]:
    """The JSON every script writes: what was measured, where and with which command."""
    doc = {"benchmark": kind, "environment": environment_info(device),
           "args": vars(args) if args is not None else None, "rows": rows}
    doc.update(extra)
    return doc


def progress(items: Sequence, desc: str):
    """Yields the items, first printing one line per item on stderr: its number and the
    time elapsed, flushed, so a long run shows where it is in a terminal and a log alike."""
    start = time.monotonic()
    for i, item in enumerate(items, 1):
        print(f"{desc}: {i}/{len(items)}, {time.monotonic() - start:.0f} s elapsed",
              file=sys.stderr, flush=True)
        yield item


def plain_int_formatter():
    """Axis labels 512, 1024, ... instead of 2^9, 2^10."""
    from matplotlib.ticker import FuncFormatter
    return FuncFormatter(lambda x, _pos: f"{x:g}" if x < 1024 else f"{x / 1024:g}k")


def matplotlib_pyplot():
    """matplotlib.pyplot, or None (saying so) when matplotlib is not installed: the setup
    does not install it, and the tables and files do not need it."""
    try:
        import matplotlib
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install '.[bench]' installs it)",
              flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
