"""One op path (issue 11): torch.jit.trace of a model that calls flash_attn_func
records the flashattn_ext:: op itself, not a Python op, so the saved module runs
from C++ with the CMake-built library and no Python at all.

examples/run_traced_module.cpp (built by the session's CMake build, conftest.py's
cmake_cpu_build, with FLASHATTN_BUILD_EXAMPLES=ON) loads the saved module with
torch::jit::load, runs it on inputs saved here with torch.save, and writes its
output with torch::jit::pickle_save; the output must match the model's in this process.
Both processes run the same CPU kernel.
"""

from __future__ import annotations

import subprocess
import warnings

import pytest
import torch

from flashattn_ext import flash_attn_func


class GroupedQueryAttention(torch.nn.Module):
    """Causal self-attention with 4 query heads sharing 2 key/value heads (GQA), of
    head dim 20: not a multiple of 8, so flash_attn_func pads it, which the trace records too."""

    def __init__(self, nheads=4, nheads_kv=2, head_dim=20):
        super().__init__()
        self.nheads, self.nheads_kv, self.head_dim = nheads, nheads_kv, head_dim
        model_dim = nheads * head_dim
        self.q_proj = torch.nn.Linear(model_dim, nheads * head_dim)
        self.kv_proj = torch.nn.Linear(model_dim, 2 * nheads_kv * head_dim)
        self.out_proj = torch.nn.Linear(nheads * head_dim, model_dim)

    def forward(self, x):
        batch, seqlen, _ = x.shape
        q = self.q_proj(x).view(batch, seqlen, self.nheads, self.head_dim)
        k, v = self.kv_proj(x).view(batch, seqlen, 2, self.nheads_kv, self.head_dim).unbind(2)
        out = flash_attn_func(q, k, v, causal=True)
        return self.out_proj(out.reshape(batch, seqlen, -1))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GroupedQueryAttention().eval()


def _trace(model, grad_enabled):
    with torch.set_grad_enabled(grad_enabled), warnings.catch_warnings():
        # TorchScript's deprecation, and the TracerWarnings of flash_attn_func's shape checks.
        warnings.simplefilter("ignore")
        return torch.jit.trace(model, torch.randn(2, 16, 80))


# With grad enabled the op runs through its autograd formula, a Python kernel
# (flashattn_ext/ops.py): the trace must record the op there too, not a Python op.
@pytest.mark.parametrize("grad_enabled", [False, True], ids=["no_grad", "grad"])
def test_trace_records_the_op_not_a_python_op(model, grad_enabled):
    graph = str(_trace(model, grad_enabled).inlined_graph)
    assert "flashattn_ext::attention_forward" in graph, graph
    assert "prim::PythonOp" not in graph, graph


def test_traced_module_runs_from_cpp(model, cmake_cpu_build, tmp_path):
    traced = _trace(model, grad_enabled=False)  # traced for inference, as for deployment
    program = cmake_cpu_build.directory / "run_traced_module"
    assert program.is_file(), f"no {program}:\n{cmake_cpu_build.log[-5000:]}"
    module_path, inputs_path, output_path = (tmp_path / name for name in
                                             ("attention.pt", "inputs.pt", "output.pt"))
    traced.save(str(module_path))
    # Another batch and length than the trace saw: the module is not specialised to them.
    x = torch.randn(3, 45, 80, generator=torch.Generator().manual_seed(1))
    torch.save((x,), inputs_path)

    proc = subprocess.run([str(program), str(module_path), str(inputs_path), str(output_path)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, f"{program} failed (exit {proc.returncode}):\n{proc.stdout}"

    with torch.no_grad():
        expected = model(x)
    got = torch.load(output_path)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
