"""Every argument check raises with a message that names the argument and says what
it got: through flash_attn_func and the packed functions (whose own checks,
flashattn_ext/checks.py, cover only what the ops never see) and through the ops
(csrc/attention_api.cpp, the one copy of the checks).

The op-level table runs twice: on CPU tensors (the CPU kernels) and on meta tensors
(the Meta kernels that FakeTensor and torch.compile run), which share the checks."""

import math
import subprocess
import sys
import textwrap

import pytest
import torch

import flashattn_ext
from flashattn_ext import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func

forward_op = torch.ops.flashattn_ext.attention_forward
backward_op = torch.ops.flashattn_ext.attention_backward


def qkv(batch=1, seqlen_q=4, seqlen_k=5, nheads=2, nheads_kv=2, head_dim=16, dtype=torch.float32,
        device="cpu"):
    make = lambda *shape: torch.randn(*shape).to(device=device, dtype=dtype)  # noqa: E731
    return (make(batch, seqlen_q, nheads, head_dim), make(batch, seqlen_k, nheads_kv, head_dim),
            make(batch, seqlen_k, nheads_kv, head_dim))


def strided_last_dim(t):
    """t's values with a last-dim stride of 2 (a view of a wider tensor)."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    return wide[..., ::2]


def forward_args(q, k, v, **overrides):
    args = dict(softmax_scale=0.25, causal=False, window_left=-1, window_right=-1, softcap=0.0,
                alibi_slopes=None, dropout_p=0.0, rng_state=None)
    args.update(overrides)
    return (q, k, v, args["softmax_scale"], args["causal"], args["window_left"], args["window_right"],
            args["softcap"], args["alibi_slopes"], args["dropout_p"], args["rng_state"])


# ---------------------------------------------------------------------------
# flash_attn_func and the packed variants


def with_q(**changes):
    def call():
        q, k, v = qkv(**changes)
        return flash_attn_func(q, k, v)
    return call


def with_tensors(transform, **kwargs):
    def call():
        q, k, v = transform(*qkv())
        return flash_attn_func(q, k, v, **kwargs)
    return call


def with_kwargs(**kwargs):
    def call():
        q, k, v = qkv()
        return flash_attn_func(q, k, v, **kwargs)
    return call


PYTHON_CHECKS = [
    ("q_rank", with_tensors(lambda q, k, v: (q[0], k, v)), RuntimeError,
     r"flashattn_ext: q must have 4 dimensions \(batch, seqlen, nheads, head_dim\) \(no cu_seqlens given\), "
     r"got 3 dimensions with shape \[4, 2, 16\]"),
    ("k_rank", with_tensors(lambda q, k, v: (q, k[None], v)), RuntimeError,
     r"k must have 4 dimensions .*got 5 dimensions"),
    ("v_rank", with_tensors(lambda q, k, v: (q, k, v[0])), RuntimeError, r"v must have 4 dimensions"),
    ("q_not_a_tensor", with_tensors(lambda q, k, v: (q.tolist(), k, v)), TypeError,
     r"q must be a torch.Tensor, got list"),
    ("k_dtype_mismatch", with_tensors(lambda q, k, v: (q, k.double(), v)), RuntimeError,
     r"k must have the same dtype as q: got Double, expected Float"),
    ("v_dtype_mismatch", with_tensors(lambda q, k, v: (q, k, v.half())), RuntimeError,
     r"v must have the same dtype as q: got Half, expected Float"),
    ("unsupported_dtype_int32", with_tensors(lambda q, k, v: (q.int(), k.int(), v.int())), RuntimeError,
     r"dtype Int is not supported on CPU \(q, k and v must share a supported dtype\)"),
    ("device_mismatch_meta", with_tensors(lambda q, k, v: (q, k.to("meta"), v)), RuntimeError,
     r"k must be on the same device as q: got meta, expected cpu"),
    ("v_device_mismatch_meta", with_tensors(lambda q, k, v: (q, k, v.to("meta"))), RuntimeError,
     r"v must be on the same device as q: got meta, expected cpu"),
    ("head_dim_over_256", with_q(head_dim=264), RuntimeError,
     r"head_dim \(q's last dim\) must be at most 256, got 264"),
    ("head_dim_257_before_padding", with_q(head_dim=257), RuntimeError, r"must be at most 256, got 257"),
    ("k_head_dim_mismatch", with_tensors(lambda q, k, v: (q, k[..., :8], v)), RuntimeError,
     r"k head_dim \(dim 3\) must match q: got 8, expected 16"),
    ("k_batch_mismatch", with_tensors(lambda q, k, v: (q, torch.cat([k, k]), torch.cat([v, v]))), RuntimeError,
     r"k batch size \(dim 0\) must match q: got 2, expected 1"),
    ("v_batch_mismatch", with_tensors(lambda q, k, v: (q, k, torch.cat([v, v]))), RuntimeError,
     r"v batch size \(dim 0\) must match k: got 2, expected 1"),
    ("v_seqlen_mismatch", with_tensors(lambda q, k, v: (q, k, v[:, :3])), RuntimeError,
     r"v seqlen \(dim 1\) must match k: got 3, expected 5"),
    ("v_nheads_mismatch", with_tensors(lambda q, k, v: (q, k, v[:, :, :1])), RuntimeError,
     r"v nheads \(dim 2\) must match k: got 1, expected 2"),
    ("nheads_not_divisible", with_q(nheads=3, nheads_kv=2), RuntimeError,
     r"q nheads \(dim 2\) must be a multiple of k nheads \(dim 2\): got 3 and 2"),
    ("dropout_negative", with_kwargs(dropout_p=-0.1), RuntimeError, r"dropout_p must be in \[0, 1\), got -0.1"),
    ("dropout_one", with_kwargs(dropout_p=1.0), RuntimeError, r"dropout_p must be in \[0, 1\), got 1$"),
    ("softmax_scale_inf", with_kwargs(softmax_scale=math.inf), RuntimeError,
     r"softmax_scale must be finite, got inf"),
    ("softmax_scale_nan", with_kwargs(softmax_scale=math.nan), RuntimeError,
     r"softmax_scale must be finite, got nan"),
    ("softcap_negative", with_kwargs(softcap=-1.0), RuntimeError,
     r"softcap must be finite and >= 0 \(0 turns it off\), got -1$"),
    ("window_size_one_int", with_kwargs(window_size=(3,)), TypeError,
     r"window_size must be a pair of ints \(left, right\), -1 meaning unbounded: got \(3,\)"),
    ("window_size_float", with_kwargs(window_size=(1.5, 2)), TypeError, r"window_size must be a pair of ints"),
    ("window_size_scalar", with_kwargs(window_size=4), TypeError, r"window_size must be a pair of ints.*got 4"),
    ("window_size_bool", with_kwargs(window_size=(True, -1)), TypeError, r"window_size must be a pair of ints"),
    ("alibi_shape", with_kwargs(alibi_slopes=torch.ones(3)), RuntimeError,
     r"alibi_slopes must have shape \(nheads,\) = \(2,\) or \(batch, nheads\) = \(1, 2\), got \[3\]"),
    ("alibi_shape_2d", with_kwargs(alibi_slopes=torch.ones(2, 2)), RuntimeError,
     r"alibi_slopes must have shape .*got \[2, 2\]"),
    ("alibi_dtype", with_kwargs(alibi_slopes=torch.ones(2, dtype=torch.float64)), RuntimeError,
     r"alibi_slopes must be float32, got Double"),
    ("alibi_device", with_kwargs(alibi_slopes=torch.ones(2, device="meta")), RuntimeError,
     r"alibi_slopes must be on the same device as q: got meta, expected cpu"),
    ("alibi_last_dim_stride", with_kwargs(alibi_slopes=torch.ones(1, 4)[:, ::2]), RuntimeError,
     r"alibi_slopes must be contiguous in its last dimension: got stride 2, expected 1"),
    ("sink_not_a_tensor", with_kwargs(learnable_sink=[0.0, 0.0]), TypeError,
     r"learnable_sink must be a torch.Tensor, got list"),
    ("sink_shape", with_kwargs(learnable_sink=torch.zeros(1, 2)), RuntimeError,
     r"learnable_sink must have shape \(nheads,\) = \(2,\), got \[1, 2\]"),
    ("sink_dtype", with_kwargs(learnable_sink=torch.zeros(2, dtype=torch.bfloat16)), RuntimeError,
     r"learnable_sink must be float32, got BFloat16"),
    ("sink_device", with_kwargs(learnable_sink=torch.zeros(2, device="meta")), RuntimeError,
     r"learnable_sink must be on the same device as q: got meta, expected cpu"),
    ("sink_stride", with_kwargs(learnable_sink=torch.zeros(4)[::2]), RuntimeError,
     r"learnable_sink must be contiguous: got stride 2, expected 1"),
    ("qkv_rank", lambda: flash_attn_qkvpacked_func(torch.randn(1, 4, 3, 16)), RuntimeError,
     r"qkv must have 5 dimensions \(batch, seqlen, 3, nheads, head_dim\), got 4 dimensions"),
    ("qkv_not_three", lambda: flash_attn_qkvpacked_func(torch.randn(1, 4, 2, 2, 16)), RuntimeError,
     r"qkv dim 2 must be 3 .*got 2, expected 3"),
    ("kv_not_two", lambda: flash_attn_kvpacked_func(torch.randn(1, 4, 2, 16), torch.randn(1, 5, 3, 2, 16)),
     RuntimeError, r"kv dim 2 must be 2 .*got 3, expected 2"),
    ("kv_rank", lambda: flash_attn_kvpacked_func(torch.randn(1, 4, 2, 16), torch.randn(1, 5, 2, 16)),
     RuntimeError, r"kv must have 5 dimensions"),
    ("kvpacked_q_rank", lambda: flash_attn_kvpacked_func(torch.randn(4, 2, 16), torch.randn(1, 5, 2, 2, 16)),
     RuntimeError, r"q must have 4 dimensions"),
]


@pytest.mark.parametrize("call,exception,pattern", [p[1:] for p in PYTHON_CHECKS],
                         ids=[p[0] for p in PYTHON_CHECKS])
def test_flash_attn_func_checks(call, exception, pattern):
    with pytest.raises(exception, match=pattern) as info:
        call()
    assert str(info.value).startswith("flashattn_ext: "), str(info.value)


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_flash_attn_func_unsupported_cuda_dtype(dtype):
    q, k, v = qkv(dtype=dtype, device="cuda")
    name = {torch.float32: "Float", torch.float64: "Double"}[dtype]
    with pytest.raises(RuntimeError, match=rf"dtype {name} is not supported on CUDA"):
        flash_attn_func(q, k, v)


@requires_cuda
def test_flash_attn_func_device_mismatch_cuda():
    q, k, v = qkv(dtype=torch.float16, device="cuda")
    with pytest.raises(RuntimeError, match=r"k must be on the same device as q: got cpu, expected cuda:0"):
        flash_attn_func(q, k.cpu(), v)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_flash_attn_func_device_index_mismatch():
    q, k, v = qkv(dtype=torch.float16, device="cuda:0")
    with pytest.raises(RuntimeError, match=r"v must be on the same device as q: got cuda:1, expected cuda:0"):
        flash_attn_func(q, k, v.to("cuda:1"))


# ---------------------------------------------------------------------------
# The ops: the CPU kernels and the Meta kernels, one copy of the checks.


def op_forward(transform=lambda q, k, v: (q, k, v), make=qkv, learnable_sink=None, **overrides):
    def call(device):
        q, k, v = transform(*make(device=device))
        # Tensor arguments are given as functions of the device, so they follow q.
        resolved = {name: value(device) if callable(value) else value for name, value in overrides.items()}
        sink = learnable_sink(device) if learnable_sink is not None else None
        return forward_op(*forward_args(q, k, v, **resolved), learnable_sink=sink)
    return call


def op_backward(transform):
    """Calls the backward op on a valid set of inputs changed by transform(dict)."""
    def call(device):
        q, k, v = qkv(device=device)
        inputs = dict(dout=torch.randn_like(q), q=q, k=k, v=v, out=torch.randn_like(q),
                      lse=torch.zeros(1, 2, 4, device=device))
        inputs = transform(inputs)
        return backward_op(inputs["dout"], inputs["q"], inputs["k"], inputs["v"], inputs["out"],
                           inputs["lse"], 0.25, False, -1, -1, 0.0, None, 0.0, None, False)
    return call


def replace(**changes):
    def transform(inputs):
        return {**inputs, **{name: change(inputs[name]) for name, change in changes.items()}}
    return transform


OP_CHECKS = [
    ("q_rank", op_forward(lambda q, k, v: (q[0], k, v)), RuntimeError,
     r"flashattn_ext: q must have 4 dimensions \(batch, seqlen, nheads, head_dim\) \(no cu_seqlens given\), "
     r"got 3 dimensions with shape \[4, 2, 16\]"),
    ("k_dtype_mismatch", op_forward(lambda q, k, v: (q, k.double(), v)), RuntimeError,
     r"k must have the same dtype as q: got Double, expected Float"),
    ("unsupported_dtype_int32", op_forward(lambda q, k, v: (q.int(), k.int(), v.int())), RuntimeError,
     r"dtype Int is not supported on (CPU|Meta)"),
    ("head_dim_over_256", op_forward(make=lambda device: qkv(head_dim=264, device=device)), RuntimeError,
     r"head_dim \(q's last dim\) must be at most 256, got 264"),
    ("head_dim_not_multiple_of_8", op_forward(make=lambda device: qkv(head_dim=12, device=device)),
     RuntimeError, r"head_dim \(q's last dim\) must be a multiple of 8 \(flash_attn_func pads it\), got 12"),
    ("k_head_dim_mismatch", op_forward(lambda q, k, v: (q, k[..., :8], v)), RuntimeError,
     r"k head_dim \(dim 3\) must match q: got 8, expected 16"),
    ("v_seqlen_mismatch", op_forward(lambda q, k, v: (q, k, v[:, :3])), RuntimeError,
     r"v seqlen \(dim 1\) must match k: got 3, expected 5"),
    ("nheads_not_divisible", op_forward(make=lambda device: qkv(nheads=3, nheads_kv=2, device=device)),
     RuntimeError, r"q nheads \(dim 2\) must be a multiple of k nheads \(dim 2\): got 3 and 2"),
    ("k_last_dim_stride", op_forward(lambda q, k, v: (q, strided_last_dim(k), v)), RuntimeError,
     r"k must be contiguous in its last dimension \(head_dim\): got stride 2, expected 1"),
    ("dropout_out_of_range", op_forward(dropout_p=1.5), RuntimeError,
     r"dropout_p must be in \[0, 1\), got 1.5"),
    ("softmax_scale_inf", op_forward(softmax_scale=math.inf), RuntimeError,
     r"softmax_scale must be finite, got inf"),
    ("softcap_negative", op_forward(softcap=-0.5), RuntimeError, r"softcap must be finite and >= 0"),
    ("alibi_shape", op_forward(alibi_slopes=lambda device: torch.ones(1, 3, device=device)), RuntimeError,
     r"alibi_slopes must have shape \(nheads,\) = \(2,\) or \(batch, nheads\) = \(1, 2\), got \[1, 3\]"),
    ("alibi_dtype", op_forward(alibi_slopes=lambda device: torch.ones(2, dtype=torch.float16, device=device)), RuntimeError,
     r"alibi_slopes must be float32, got Half"),
    ("sink_shape", op_forward(learnable_sink=lambda device: torch.zeros(3, device=device)), RuntimeError,
     r"learnable_sink must have shape \(nheads,\) = \(2,\), got \[3\]"),
    ("sink_dtype", op_forward(learnable_sink=lambda device: torch.zeros(2, dtype=torch.float64, device=device)),
     RuntimeError, r"learnable_sink must be float32, got Double"),
    ("sink_stride", op_forward(learnable_sink=lambda device: torch.zeros(4, device=device)[::2]), RuntimeError,
     r"learnable_sink must be contiguous: got stride 2, expected 1"),
    ("backward_dout_shape", op_backward(replace(dout=lambda t: t[:, :3])), RuntimeError,
     r"dout must have the shape of q: got \[1, 3, 2, 16\], expected \[1, 4, 2, 16\]"),
    ("backward_out_shape", op_backward(replace(out=lambda t: t[..., :8])), RuntimeError,
     r"out must have the shape of q: got \[1, 4, 2, 8\], expected \[1, 4, 2, 16\]"),
    ("backward_dout_dtype", op_backward(replace(dout=lambda t: t.double())), RuntimeError,
     r"dout must have the same dtype as q: got Double, expected Float"),
    ("backward_dout_rank", op_backward(replace(dout=lambda t: t[0])), RuntimeError,
     r"dout must have 4 dimensions"),
    ("backward_out_last_dim_stride", op_backward(replace(out=strided_last_dim)), RuntimeError,
     r"out must be contiguous in its last dimension \(head_dim\): got stride 2, expected 1"),
    ("backward_lse_shape", op_backward(replace(lse=lambda t: t[:, :, :3])), RuntimeError,
     r"lse must have shape \(batch, nheads, seqlen_q\) = \[1, 2, 4\], got \[1, 2, 3\]"),
    ("backward_lse_dtype", op_backward(replace(lse=lambda t: t.double())), RuntimeError,
     r"lse must be float32 \(float64 for float64 inputs, else float32\), got Double"),
    ("backward_q_rank", op_backward(replace(q=lambda t: t[0])), RuntimeError, r"q must have 4 dimensions"),
]


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("call,exception,pattern", [p[1:] for p in OP_CHECKS], ids=[p[0] for p in OP_CHECKS])
def test_op_checks(call, exception, pattern, device):
    with pytest.raises(exception, match=pattern) as info:
        call(device)
    assert str(info.value).startswith("flashattn_ext: ") or "\nflashattn_ext: " in str(info.value)


def test_op_requires_rng_state_for_dropout():
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match=r"rng_state \(int64 \[seed, offset\]\) is required when dropout_p > 0"):
        forward_op(*forward_args(q, k, v, dropout_p=0.2))


def test_sink_device_mismatch_op():
    # A meta sink routes the call to the Meta kernel, whose checks name the mismatch.
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match=r"learnable_sink must be on the same device as q: got meta, expected cpu"):
        forward_op(*forward_args(q, k, v), learnable_sink=torch.zeros(2, device="meta"))


def test_meta_kernel_requires_rng_state_for_dropout():
    q, k, v = qkv(device="meta")
    with pytest.raises(RuntimeError, match=r"rng_state \(int64 \[seed, offset\]\) is required when dropout_p > 0"):
        forward_op(*forward_args(q, k, v, dropout_p=0.2))
    with pytest.raises(RuntimeError, match=r"rng_state must be an int64 tensor of 2 elements"):
        forward_op(*forward_args(q, k, v, dropout_p=0.2, rng_state=torch.zeros(3, dtype=torch.int64,
                                                                               device="meta")))


def test_meta_forward_shapes():
    q, k, v = qkv(batch=2, seqlen_q=7, seqlen_k=9, nheads=4, nheads_kv=2, head_dim=32, device="meta")
    out, lse = forward_op(*forward_args(q.transpose(1, 2).contiguous().transpose(1, 2), k, v))
    assert out.shape == q.shape and out.is_contiguous() and out.device.type == "meta"
    assert lse.shape == (2, 4, 7) and lse.dtype == torch.float32


requires_cuda_kernels = pytest.mark.skipif(
    not (torch.cuda.is_available() and flashattn_ext.ops.HAS_CUDA_KERNELS),
    reason="needs a CUDA device and a build with the CUDA kernels")


@requires_cuda_kernels
def test_op_device_mismatch_cuda():
    q, k, v = qkv(dtype=torch.float16, device="cuda")
    with pytest.raises(RuntimeError, match=r"k must be on the same device as q: got cpu, expected cuda:0"):
        forward_op(*forward_args(q, k.cpu(), v))


@requires_cuda_kernels
def test_op_unsupported_cuda_dtype():
    q, k, v = qkv(dtype=torch.float64, device="cuda")
    with pytest.raises(RuntimeError, match=r"dtype Double is not supported on CUDA"):
        forward_op(*forward_args(q, k, v))


def test_op_device_mismatch_meta():
    # A meta k routes the call to the Meta kernel, whose checks name the mismatch.
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match=r"k must be on the same device as q: got meta, expected cpu"):
        forward_op(*forward_args(q, k.to("meta"), v))


def test_cpp_error_raises_in_a_fresh_process(tmp_path):
    """The first C++ error of a process raises, it does not crash it. Seen on a
    machine whose compiler linked libstdc++ statically into the extension: every
    TORCH_CHECK message segfaulted (setup.py's libstdcxx_link_args is the fix).
    Run in a subprocess so that such a crash fails this test instead of pytest."""
    script = textwrap.dedent("""
        import torch, flashattn_ext
        q = torch.randn(1, 4, 2, 16)
        try:
            torch.ops.flashattn_ext.attention_forward(q[0], q, q, 0.25, False, -1, -1, 0.0, None, 0.0, None)
        except RuntimeError as e:
            print("raised:", str(e).splitlines()[0])
    """)
    # From a folder outside the source tree, so the installed package is imported.
    run = subprocess.run([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, f"exit {run.returncode}:\n{run.stdout[-2000:]}"
    assert "raised:" in run.stdout and "q" in run.stdout, run.stdout
