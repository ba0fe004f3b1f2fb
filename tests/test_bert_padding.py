"""flashattn_ext.bert_padding: flash-attn's padding helpers, checked by their definitions and
by attention on a padded batch against the varlen functions on its unpadded form."""

import pytest
import torch

from flashattn_ext import flash_attn_func, flash_attn_varlen_func
from flashattn_ext.bert_padding import (index_first_axis, index_put_first_axis, pad_input, unpad_input,
                                        unpad_input_for_concatenated_sequences)


def padded_batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = [5, 0, 8, 3]
    mask = torch.zeros(4, 8, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, :n] = True
    return torch.randn(4, 8, 2, 16, generator=gen), mask, lengths


def test_unpad_input_keeps_the_real_tokens_in_order():
    x, mask, lengths = padded_batch()
    rows, indices, cu_seqlens, max_seqlen, used = unpad_input(x, mask)
    assert torch.equal(rows, x[mask]) and torch.equal(indices, torch.nonzero(mask.flatten()).flatten())
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 5, 5, 13, 16]
    assert max_seqlen == 8 and isinstance(max_seqlen, int)
    assert used.dtype == torch.int32 and used.tolist() == lengths


def test_pad_input_inverts_unpad_input_and_zeroes_the_padding():
    x, mask, _ = padded_batch()
    rows, indices, *_ = unpad_input(x, mask)
    padded = pad_input(rows, indices, 4, 8)
    assert padded.shape == x.shape
    assert torch.equal(padded[mask], x[mask]) and not padded[~mask].any()


def test_unused_tokens_are_kept_after_the_used_ones():
    """FA3's seqused: allocated but unused tokens stay among the rows; used lengths count the
    attention_mask alone."""
    x, mask, lengths = padded_batch()
    unused = torch.zeros_like(mask)
    unused[0, 5:7] = True
    unused[1, 0] = True
    rows, indices, cu_seqlens, max_seqlen, used = unpad_input(x, mask, unused)
    assert cu_seqlens.tolist() == [0, 7, 8, 16, 19] and max_seqlen == 8 and used.tolist() == lengths
    assert torch.equal(rows, x[mask | unused])


def test_index_helpers_are_differentiable():
    x = torch.randn(6, 3, requires_grad=True)
    indices = torch.tensor([4, 0, 2])
    picked = index_first_axis(x, indices)
    (grad,) = torch.autograd.grad(picked.sum(), x)
    assert torch.equal(grad, torch.tensor([1.0, 0, 1, 0, 1, 0])[:, None].expand(6, 3))
    values = torch.randn(3, 3, requires_grad=True)
    placed = index_put_first_axis(values, indices, 6)
    assert torch.equal(placed[indices], values) and not placed[[1, 3, 5]].any()
    (grad,) = torch.autograd.grad((placed * 2).sum(), values)
    assert torch.equal(grad, torch.full((3, 3), 2.0))


def test_concatenated_sequences():
    lengths_in_rows = torch.tensor([[2, 1, 0, 0], [4, 0, 0, 0], [1, 1, 1, 0]])
    x = torch.randn(3, 4, 5)
    rows, indices, cu_seqlens, max_seqlen = unpad_input_for_concatenated_sequences(x, lengths_in_rows)
    assert indices.tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 9, 10]
    assert cu_seqlens.tolist() == [0, 2, 3, 7, 8, 9, 10] and max_seqlen == 4
    assert torch.equal(rows, x.flatten(0, 1)[indices])


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_attention_on_unpadded_rows_matches_each_sequence(causal):
    """What the helpers are for: attention over a padded batch through flash_attn_varlen_func
    on its unpadded rows, padded back, equals each sequence run alone."""
    x, mask, lengths = padded_batch(1)
    q, k, v = x, x.flip(-1), x * 0.5
    q_rows, indices, cu_seqlens, max_seqlen, _ = unpad_input(q, mask)
    k_rows, v_rows = index_first_axis(k.flatten(0, 1), indices), index_first_axis(v.flatten(0, 1), indices)
    out_rows = flash_attn_varlen_func(q_rows, k_rows, v_rows, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                      causal=causal)
    out = pad_input(out_rows, indices, 4, 8)
    for b, n in enumerate(lengths):
        if n == 0:
            assert not out[b].any()
            continue
        alone = flash_attn_func(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], causal=causal)
        torch.testing.assert_close(out[b:b + 1, :n], alone, rtol=1e-6, atol=1e-6)
        assert not out[b, n:].any()
