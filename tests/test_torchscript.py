"""A TorchScript function calling the op directly, saved and loaded back."""

import warnings

import torch

import flashattn_ext  # noqa: F401  (registers the ops TorchScript resolves)

from sample_inputs import CASES_BY_NAME

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # TorchScript is deprecated upstream; it must still work

    @torch.jit.script
    def scripted_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
                           causal: bool):
        return torch.ops.flashattn_ext.attention_forward(q, k, v, softmax_scale, causal, -1, -1, 0.0,
                                                         None, 0.0, None)


class ScriptedAttention(torch.nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        out, lse = scripted_attention(q, k, v, 0.25, True)
        return out, lse


def test_torchscript_save_and_load(tmp_path):
    inputs = CASES_BY_NAME["gqa_2"].make(torch.float32)
    expected = torch.ops.flashattn_ext.attention_forward(inputs.q, inputs.k, inputs.v, 0.25, True, -1,
                                                         -1, 0.0, None, 0.0, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = torch.jit.script(ScriptedAttention())
        path = tmp_path / "attention.pt"
        torch.jit.save(module, str(path))
        loaded = torch.jit.load(str(path))
    assert "flashattn_ext::attention_forward" in loaded.code or "flashattn_ext.attention_forward" in str(
        loaded.graph) or "attention_forward" in str(loaded.inlined_graph)
    for scripted in (scripted_attention, module, loaded):
        out, lse = (scripted(inputs.q, inputs.k, inputs.v, 0.25, True) if scripted is scripted_attention
                    else scripted(inputs.q, inputs.k, inputs.v))
        assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])
