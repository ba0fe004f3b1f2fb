"""torch.compile (fullgraph, no recompiles) and torch.export see each op as one
opaque node and give the eager results."""

import dataclasses

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend
from torch._functorch.aot_autograd import make_boxed_func

from flashattn_ext import flash_attn_func, flash_attn_varlen_func

from sample_inputs import CASES_BY_NAME, VARLEN_CASES, VARLEN_CASES_BY_NAME, cases_tagged, paged_keys

FORWARD_OP = torch.ops.flashattn_ext.attention_forward.default
BACKWARD_OP = torch.ops.flashattn_ext.attention_backward.default


def count_calls(graph_module, target):
    return sum(1 for node in graph_module.graph.nodes
               if node.op == "call_function" and node.target == target)


class GraphRecorder:
    """An AOT-autograd backend that keeps the forward and backward graphs it is given."""

    def __init__(self):
        self.forward_graphs, self.backward_graphs = [], []

        def keep(graphs):
            def compiler(graph_module, example_inputs):
                graphs.append(graph_module)
                return make_boxed_func(graph_module.forward)
            return compiler

        self.backend = aot_autograd(fw_compiler=keep(self.forward_graphs),
                                    bw_compiler=keep(self.backward_graphs))


def make_step(case):
    """The compiled function: attention and a loss-like product, with the
    tensors as arguments (a closed-over tensor would be a guarded constant)."""
    kwargs = case.make(torch.float32).func_kwargs()
    kwargs.pop("alibi_slopes")
    kwargs.pop("learnable_sink")

    def step(q, k, v, alibi_slopes, learnable_sink):
        out, lse, _ = flash_attn_func(q, k, v, alibi_slopes=alibi_slopes, return_attn_probs=True,
                                      learnable_sink=learnable_sink, **kwargs)
        return out * 2.0, lse

    return step


def run_step(step, inputs):
    out, lse = step(inputs.q, inputs.k, inputs.v, inputs.alibi_slopes, inputs.learnable_sink)
    grads = torch.autograd.grad(out, inputs.differentiable(), inputs.dout)
    return (out, lse, *grads)


@pytest.mark.parametrize("case", cases_tagged("compile"), ids=str)
def test_compile_fullgraph_without_recompiles(case):
    torch._dynamo.reset()
    recorder = GraphRecorder()
    counter = CompileCounterWithBackend(recorder.backend)
    step = make_step(case)
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in (0, 1):  # same shapes, new values: must reuse the first compilation
            inputs = case.make(torch.float32, requires_grad=True, seed=seed)
            actual = run_step(compiled, inputs)
            expected = run_step(step, inputs)
            for name, a, e in zip(("out", "lse", "dq", "dk", "dv", "dsink"), actual, expected):
                torch.testing.assert_close(a, e, rtol=0, atol=0, msg=f"{case.name} {name}")
    assert counter.frame_count == 1
    (forward_graph,) = recorder.forward_graphs
    (backward_graph,) = recorder.backward_graphs
    assert count_calls(forward_graph, FORWARD_OP) == 1
    assert count_calls(backward_graph, BACKWARD_OP) == 1


@pytest.mark.parametrize("case", [case for case in VARLEN_CASES if "compile" in case.tags], ids=str)
def test_compile_varlen_fullgraph_without_recompiles(case):
    """flash_attn_varlen_func: one forward and one backward op, the sequence tensors
    graph inputs (new values reuse the graph), the eager results."""
    torch._dynamo.reset()
    recorder = GraphRecorder()
    counter = CompileCounterWithBackend(recorder.backend)
    first = case.make(torch.float32, requires_grad=True)
    *_, max_seqlen_q, max_seqlen_k = first.sequence_args
    kwargs = first.func_kwargs()

    def step(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
        out, lse, _ = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                             return_attn_probs=True, seqused_q=seqused_q,
                                             seqused_k=seqused_k, **kwargs)
        return out * 2.0, lse

    def run(function, inputs):
        out, lse = function(inputs.q, inputs.k, inputs.v, *inputs.sequence_args[:4])
        return (out, lse, *torch.autograd.grad(out, (inputs.q, inputs.k, inputs.v), inputs.dout))

    compiled = torch.compile(step, backend=counter, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in (0, 1):
            inputs = case.make(torch.float32, requires_grad=True, seed=seed)
            for name, a, e in zip(("out", "lse", "dq", "dk", "dv"), run(compiled, inputs), run(step, inputs)):
                torch.testing.assert_close(a, e, rtol=0, atol=0, msg=f"{case.name} {name}")
    assert counter.frame_count == 1
    (forward_graph,) = recorder.forward_graphs
    (backward_graph,) = recorder.backward_graphs
    assert count_calls(forward_graph, FORWARD_OP) == 1
    assert count_calls(backward_graph, BACKWARD_OP) == 1


def test_compile_paged_varlen_fullgraph():
    """flash_attn_varlen_func with block_table: the gather of the pages traces (its value checks
    are eager-only), one forward and one backward op, the eager results."""
    torch._dynamo.reset()
    recorder = GraphRecorder()
    counter = CompileCounterWithBackend(recorder.backend)
    case = VARLEN_CASES_BY_NAME["mixed_lengths"]
    inputs = case.make(torch.float32, requires_grad=True)
    cu_q, cu_k, _, _, max_q, max_k = inputs.sequence_args
    paged = paged_keys(inputs.k, inputs.v, case.seqlens_k, page_size=16, requires_grad=True)

    def step(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_table):
        out = flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_q, max_k, causal=True,
                                     block_table=block_table)
        return out * 2.0

    def run(function):
        out = function(inputs.q, paged.k_cache, paged.v_cache, cu_q, cu_k, paged.block_table)
        return (out, *torch.autograd.grad(out, (inputs.q, paged.k_cache, paged.v_cache), inputs.dout))

    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for name, a, e in zip(("out", "dq", "dk_cache", "dv_cache"), run(compiled), run(step)):
        torch.testing.assert_close(a, e, rtol=0, atol=0, msg=name)
    assert counter.frame_count == 1
    (forward_graph,) = recorder.forward_graphs
    (backward_graph,) = recorder.backward_graphs
    assert count_calls(forward_graph, FORWARD_OP) == 1
    assert count_calls(backward_graph, BACKWARD_OP) == 1


def test_compile_dynamic_varlen_totals_compile_once():
    """dynamic=True with packed batches whose total rows change every step (padding-free
    training): the Meta kernels' checks run on the symbolic totals, one graph serves all."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    base = VARLEN_CASES_BY_NAME["mixed_lengths"]

    def step(q, k, v, cu_seqlens):
        return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, 130, 130, causal=True)

    def run(function, inputs):
        out = function(inputs.q, inputs.k, inputs.v, inputs.sequence_args[0])
        return (out, *torch.autograd.grad(out, (inputs.q, inputs.k, inputs.v), inputs.dout))

    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    frames_after_first_call = None
    with torch._dynamo.config.patch(error_on_recompile=True):
        for lengths in ((5, 0, 1, 130, 17), (9, 64, 3), (130, 2, 2, 2, 2, 40)):
            inputs = dataclasses.replace(base, seqlens_q=lengths, seqlens_k=lengths).make(
                torch.float32, requires_grad=True)
            for a, e in zip(run(compiled, inputs), run(step, inputs)):
                torch.testing.assert_close(a, e, rtol=0, atol=0)
            frames_after_first_call = frames_after_first_call or counter.frame_count
    assert counter.frame_count == frames_after_first_call


def test_compile_dynamic_seqlen_compiles_once():
    """dynamic=True: new sequence lengths reuse the one compiled graph."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    case = dataclasses.replace(CASES_BY_NAME["basic"], batch=3, nheads=4, nheads_kv=2)
    step = make_step(case)
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    frames_after_first_call = None
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seqlen in (17, 33, 40):
            inputs = dataclasses.replace(case, seqlen_q=seqlen, seqlen_k=seqlen + 3).make(
                torch.float32, requires_grad=True)
            actual = run_step(compiled, inputs)
            expected = run_step(step, inputs)
            for a, e in zip(actual, expected):
                torch.testing.assert_close(a, e, rtol=0, atol=0)
            # (Dynamo may call the backend more than once while compiling the first
            # frame, when it restarts its analysis; what matters is no new frame.)
            frames_after_first_call = frames_after_first_call or counter.frame_count
    assert counter.frame_count == frames_after_first_call


def test_compile_inductor():
    """The default backend (inductor) around the opaque op, forward and backward."""
    torch._dynamo.reset()
    case = CASES_BY_NAME["basic"]
    step = make_step(case)
    compiled = torch.compile(step, fullgraph=True)
    inputs = case.make(torch.float32, requires_grad=True)
    for a, e in zip(run_step(compiled, inputs), run_step(step, inputs)):
        torch.testing.assert_close(a, e)


class CausalAttention(torch.nn.Module):
    def forward(self, q, k, v):
        return flash_attn_func(q, k, v, causal=True, window_size=(24, -1))


def test_export_one_opaque_node():
    inputs = CASES_BY_NAME["mixed_strides"].make(torch.float32)
    exported = torch.export.export(CausalAttention(), (inputs.q, inputs.k, inputs.v))
    assert count_calls(exported.graph_module, FORWARD_OP) == 1
    expected = CausalAttention()(inputs.q, inputs.k, inputs.v)
    torch.testing.assert_close(exported.module()(inputs.q, inputs.k, inputs.v), expected, rtol=0, atol=0)


def test_export_dynamic_seqlen():
    inputs = CASES_BY_NAME["gqa_2"].make(torch.float32)
    seqlen_q, seqlen_k = torch.export.Dim("seqlen_q", min=2), torch.export.Dim("seqlen_k", min=2)
    dynamic_shapes = {"q": {1: seqlen_q}, "k": {1: seqlen_k}, "v": {1: seqlen_k}}
    exported = torch.export.export(CausalAttention(), (inputs.q, inputs.k, inputs.v),
                                   dynamic_shapes=dynamic_shapes)
    assert count_calls(exported.graph_module, FORWARD_OP) == 1
    other = dataclasses.replace(CASES_BY_NAME["gqa_2"], seqlen_q=50, seqlen_k=21).make(torch.float32)
    torch.testing.assert_close(exported.module()(other.q, other.k, other.v),
                               CausalAttention()(other.q, other.k, other.v), rtol=0, atol=0)
