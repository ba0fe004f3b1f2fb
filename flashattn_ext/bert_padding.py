"""flash-attn's padding helpers (``flash_attn.bert_padding``), for code that moves between a
padded batch and the variable-length layout of flash_attn_varlen_func: the same names,
arguments and return values (flash-attn 2.7+: unpad_input returns the used lengths too).

A padded batch is (batch, seqlen, ...) with an attention_mask (batch, seqlen), nonzero where
a token is real; its unpadded form is the real tokens concatenated, (total, ...), with the
cumulative lengths cu_seqlens (int32, batch + 1) that the varlen functions take. Plain
indexing, so autograd differentiates every function here.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """input[indices]: the rows `indices` of input's first axis."""
    return input[indices]


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """A (first_axis_dim, *values.shape[1:]) tensor of zeros with values at rows `indices`."""
    output = values.new_zeros(first_axis_dim, *values.shape[1:])
    return output.index_put((indices,), values)


def _cumulative_lengths(lengths: torch.Tensor) -> torch.Tensor:
    return F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor,
                unused_mask: Optional[torch.Tensor] = None):
    """The real tokens of a padded batch, concatenated.

    Arguments:
        hidden_states: (batch, seqlen, ...).
        attention_mask: (batch, seqlen), nonzero where a token is real (and used).
        unused_mask: (batch, seqlen), optional, nonzero where a token is kept but not used
            (FA3's seqused: it stays in the unpadded rows, after the used ones it must follow).

    Returns:
        (hidden_states (total, ...), indices (total,) of the kept tokens in the flattened
        (batch * seqlen) batch, cu_seqlens int32 (batch + 1,), max_seqlen_in_batch (int),
        used_seqlens_in_batch int32 (batch,): the attention_mask tokens of each sequence).
    """
    kept = attention_mask.bool() if unused_mask is None else attention_mask.bool() | unused_mask.bool()
    lengths = kept.sum(dim=-1, dtype=torch.int32)
    used_lengths = attention_mask.bool().sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(lengths.max()) if lengths.numel() > 0 else 0
    rows = index_first_axis(hidden_states.flatten(0, 1), indices)
    return rows, indices, _cumulative_lengths(lengths), max_seqlen_in_batch, used_lengths


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """The inverse of unpad_input: (total, ...) rows back to (batch, seqlen, ...), zeros where
    no row goes."""
    padded = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return padded.unflatten(0, (batch, seqlen))


def unpad_input_for_concatenated_sequences(
        hidden_states: torch.Tensor, attention_mask_in_length: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Unpads a batch whose rows each hold several sequences back to back (packed training):
    attention_mask_in_length (batch, seqlen) lists, from the start of each row, the lengths of
    the row's sequences (0 after the last), e.g. [2, 3, 0, 0, 0] for a row holding a sequence of
    2 tokens, then one of 3, then padding. Every sequence becomes one of the varlen batch.

    Returns:
        (hidden_states (total, ...), indices (total,) in the flattened batch, cu_seqlens int32
        (number of sequences + 1,), max_seqlen_in_batch (int)).
    """
    batch, seqlen = attention_mask_in_length.shape
    lengths_per_row = attention_mask_in_length.to(torch.int64)
    real = lengths_per_row.sum(dim=-1)
    positions = torch.arange(seqlen, device=attention_mask_in_length.device)
    indices = torch.nonzero((positions < real[:, None]).flatten(), as_tuple=False).flatten()
    lengths = lengths_per_row.flatten()
    lengths = lengths[lengths > 0].to(torch.int32)
    max_seqlen_in_batch = int(lengths.max()) if lengths.numel() > 0 else 0
    rows = index_first_axis(hidden_states.flatten(0, 1), indices)
    return rows, indices, _cumulative_lengths(lengths), max_seqlen_in_batch
