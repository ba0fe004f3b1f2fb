"""End to end on the GPU: a small causal transformer trained a few hundred steps with
flash_attn_func tracks the loss curve of the same model with PyTorch's attention
(same seed, same data) within bf16 noise. The noise is measured, not assumed: the
same model trained with PyTorch's attention in fp32 against bf16 gives the spread
that bf16 rounding alone causes, and ours must stay within 3x of it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flashattn_ext

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("kernel_family"),
]

VOCAB, DIM, HEADS, SEQ, BATCH, STEPS = 64, 128, 4, 256, 16, 300


class Block(torch.nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.attention = attention
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.position = torch.nn.Embedding(SEQ, DIM)
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.proj = torch.nn.Linear(DIM, DIM)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(), torch.nn.Linear(4 * DIM, DIM))
        self.norm1, self.norm2 = torch.nn.LayerNorm(DIM), torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens, dtype):
        x = self.embed(tokens) + self.position(torch.arange(SEQ, device=tokens.device))
        q, k, v = self.qkv(self.norm1(x)).to(dtype).view(BATCH, SEQ, 3, HEADS, DIM // HEADS).unbind(2)
        x = x + self.proj(self.attention(q, k, v).reshape(BATCH, SEQ, DIM).float())
        x = x + self.mlp(self.norm2(x))
        return self.head(x)


def ours(q, k, v):
    return flashattn_ext.flash_attn_func(q, k, v, causal=True)


def pytorch(q, k, v):  # (batch, seq, heads, d) like flash-attn
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=True).transpose(1, 2)


def train(attention, dtype):
    torch.manual_seed(0)
    model = Block(attention).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.Generator(device="cuda").manual_seed(1)
    losses = []
    for _ in range(STEPS):
        # A learnable task: each token repeats the one 7 places back.
        head = torch.randint(0, VOCAB, (BATCH, 7), device="cuda", generator=data)
        tokens = head.repeat(1, SEQ // 7 + 2)[:, : SEQ + 1]
        logits = model(tokens[:, :-1], dtype)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return torch.tensor(losses)


def test_training_tracks_pytorch_attention_within_bf16_noise():
    curve_ours = train(ours, torch.bfloat16)
    curve_bf16 = train(pytorch, torch.bfloat16)
    curve_fp32 = train(pytorch, torch.float32)
    assert torch.isfinite(curve_ours).all(), curve_ours
    # It learned: the task's loss falls far below chance (ln 64 = 4.16).
    assert curve_ours[-20:].mean() < 0.5 * curve_ours[:5].mean(), (curve_ours[:5], curve_ours[-20:])
    smooth = lambda c: c.unfold(0, 20, 20).mean(1)  # noqa: E731  (means over windows of 20 steps)
    ours_gap = (smooth(curve_ours) - smooth(curve_bf16)).abs().max().item()
    bf16_noise = (smooth(curve_fp32) - smooth(curve_bf16)).abs().max().item()
    assert ours_gap <= 3 * bf16_noise + 1e-3, (
        f"ours vs PyTorch bf16: {ours_gap:.4f}; bf16 noise (PyTorch fp32 vs bf16): {bf16_noise:.4f}")
