"""flashattn_ext as a Hugging Face transformers (>= 5.0) attention implementation.

    import flashattn_ext.integrations.transformers as fa_hf
    fa_hf.register()                       # once per process; returns the name, "fa_ext"
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="fa_ext")

``register`` installs two functions under one name: the attention function, and the
mask function transformers calls to build the mask that the attention function then
receives. Without the latter transformers passes ``attention_mask=None`` to a custom
attention function even for a padded batch, which then attends to the padding.

What the attention function receives and does, following transformers' own
flash_attention_2 path (the semantics models written for it rely on):

* no padding: ``attention_mask`` is None and the batch goes through one
  ``flash_attn_func`` call;
* padding: ``attention_mask`` is the 2-D (batch, kv_len) padding mask (any pattern,
  left or right). Each row's valid tokens are attended among themselves, causal in
  their order (bottom-right aligned when the query is shorter than the keys, as in
  decoding); the output at padded query positions is 0. The valid tokens are gathered
  into one ``flash_attn_varlen_func`` call;
* sequences packed into one row: in a batch of one row, ``position_ids`` restarting at 0
  (or anywhere they do not continue by +1) without a padding mask; or the ``cu_seq_lens_q/k`` and
  ``max_length_q/k`` keyword arguments of padding-free collators: each sequence is
  attended separately, in one ``flash_attn_varlen_func`` call;
* ``sliding_window`` (a window of that many keys including the query's own, as
  transformers defines it) becomes ``window_size``, ``softcap`` is passed through,
  ``dropout`` too: dropout > 0 (a model in training mode with attention dropout) runs
  on the CPU and on CUDA;
* attention sinks (``s_aux``, gpt-oss: one logit per head in every row's softmax
  denominator) become ``learnable_sink``, in fp32, with their gradient.

Mask patterns this cannot express are refused rather than ignored: a 4-D mask, a
model's extra mask functions (e.g. bidirectional image tokens, block overlays),
chunked attention past the chunk size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

import flashattn_ext

DEFAULT_NAME = "fa_ext"

# transformers reads meaning into these substrings of an implementation name: "flash"
# makes it import flash-attn kernels, "sdpa"/"flex" run those backends' availability
# checks, "eager" is the built-in fallback.
_RESERVED_SUBSTRINGS = ("flash", "sdpa", "flex", "eager")


def register(name: str = DEFAULT_NAME) -> str:
    """Registers the attention and mask functions under ``name`` with transformers'
    AttentionInterface and AttentionMaskInterface; returns ``name`` for
    ``attn_implementation=``. Registering again is harmless."""
    if not isinstance(name, str) or not name.isidentifier() or any(
            s in name.lower() for s in _RESERVED_SUBSTRINGS):
        raise ValueError(
            "flashattn_ext: register(name) needs a Python identifier containing none of "
            f"{_RESERVED_SUBSTRINGS} (transformers dispatches on those): got {name!r}")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask)
    return name


def padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                 attention_mask=None, config=None, use_vmap=False, **kwargs):
    """Mask function: the 2-D padding mask, or None when nothing is padded (transformers'
    flash_attention_mask), after refusing the patterns attention_forward cannot apply."""
    # use_vmap is set exactly when the model adds its own mask functions; an "or" mask
    # without it is a block overlay. Both widen the causal pattern beyond padding.
    if use_vmap or getattr(mask_function, "__name__", "") == "or_mask":
        raise NotImplementedError(
            "flashattn_ext: this model combines the causal mask with its own mask function "
            "(e.g. bidirectional image tokens or blocks), which only a dense mask can express; "
            "use attn_implementation='sdpa' for it")
    chunk_size = getattr(config, "attention_chunk_size", None)
    if chunk_size is not None and kv_length + kv_offset > chunk_size:
        raise NotImplementedError(
            f"flashattn_ext: chunked attention (attention_chunk_size={chunk_size}) over "
            f"{kv_length + kv_offset} keys is not supported; use attn_implementation='sdpa'")
    return flash_attention_mask(batch_size, q_length, kv_length, q_offset, kv_offset,
                                mask_function, attention_mask, **kwargs)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      sliding_window=None, softcap=None, is_causal=None, s_aux=None,
                      position_ids=None, cu_seq_lens_q=None, cu_seq_lens_k=None,
                      max_length_q=None, max_length_k=None, **kwargs):
    """transformers attention function: query (batch, heads, q_len, dim), key/value
    (batch, kv_heads, kv_len, dim) -> (output (batch, q_len, heads, dim), None)."""
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    key_length = key.shape[2]
    # transformers' window counts the query's own key: flash-attn's (w - 1, w - 1), which
    # flash_attention_2 applies only when the keys exceed it.
    window = ((sliding_window - 1, sliding_window - 1)
              if sliding_window is not None and key_length > sliding_window else (-1, -1))
    options = dict(dropout_p=dropout, softmax_scale=scaling, causal=bool(is_causal),
                   window_size=window, softcap=0.0 if softcap is None else softcap,
                   learnable_sink=None if s_aux is None else s_aux.float())
    # The kernels take (batch, seq, heads, dim) with any strides but the last: views.
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    batch, q_len = q.shape[:2]

    if attention_mask is not None:
        return _padded_attention(q, k, v, attention_mask, options), None
    if all(x is not None for x in (cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k)):
        out = _varlen_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                cu_seq_lens_q, cu_seq_lens_k, options, max_length_q, max_length_k)
        return out.view(batch, q_len, *out.shape[1:]), None
    starts = _packed_sequence_starts(position_ids, batch, q_len, key_length)
    if starts is not None:
        cu_seqlens = F.pad(starts.flatten().nonzero().flatten(), (0, 1), value=batch * q_len)
        out = _varlen_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                cu_seqlens, cu_seqlens, options)
        return out.view(batch, q_len, *out.shape[1:]), None
    return flashattn_ext.flash_attn_func(q, k, v, **options), None


def _padded_attention(q, k, v, attention_mask, options):
    """Gathers each row's valid tokens (mask True) into one packed sequence per row, attends
    them with _varlen_attention and scatters the result back; padded query rows get 0."""
    batch, q_len = q.shape[:2]
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch:
        raise ValueError(
            "flashattn_ext: attention_mask must be a 2-D padding mask (batch, kv_len) = "
            f"({batch}, kv_len): got shape {tuple(attention_mask.shape)} (a 4-D mask means the "
            "model built a dense mask, which this implementation cannot apply)")
    mask = attention_mask.bool()
    # A static cache holds more key slots than the mask covers; the rest are unused.
    k, v = k[:, :mask.shape[1]], v[:, :mask.shape[1]]
    mask_q = mask[:, -q_len:]   # the queries are the last q_len positions of the mask
    index_q, cu_q = _unpad_indices(mask_q)
    index_k, cu_k = _unpad_indices(mask)
    out = _varlen_attention(q.flatten(0, 1)[index_q], k.flatten(0, 1)[index_k],
                            v.flatten(0, 1)[index_k], cu_q, cu_k, options)
    padded = out.new_zeros(batch * q_len, *out.shape[1:]).index_copy(0, index_q, out)
    return padded.view(batch, q_len, *out.shape[1:])


def _unpad_indices(mask):
    """Flat indices of the True entries of a (batch, seq) mask and the cumulative row
    lengths (batch + 1,), the layout of flash-attn's varlen functions."""
    cu_seqlens = F.pad(mask.sum(dim=1).cumsum(0), (1, 0))
    return mask.flatten().nonzero().flatten(), cu_seqlens


def _packed_sequence_starts(position_ids, batch, q_len, key_length):
    """(batch, q_len) bool, True where a packed sequence starts, when position_ids show
    several sequences in a row (a position that does not continue the previous one by 1,
    transformers' own packing rule); None for one sequence per row. As transformers'
    flash_attention_2, only for a batch of one row (packing collators emit one; looking at
    every batch would cost a device synchronisation per layer) and without a cache
    (q_len == key_length): a query chunk's positions say nothing about the cached keys."""
    if position_ids is None or batch != 1 or q_len != key_length or q_len < 2:
        return None
    positions = position_ids.expand(batch, -1)
    starts = F.pad(positions.diff(dim=1) != 1, (1, 0), value=True)
    if not starts[:, 1:].any():
        return None
    return starts


def _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, options, max_seqlen_q=None,
                      max_seqlen_k=None):
    """flash_attn_varlen_func: q (total_q, heads, dim), k/v (total_k, kv_heads, dim), sequence
    i at rows cu_seqlens[i]:cu_seqlens[i + 1] (any integer dtype); returns (total_q, heads,
    dim). The longest lengths are computed from cu_seqlens (one device synchronisation)
    where the caller has none."""
    cu_seqlens_q, cu_seqlens_k = (cu.to(torch.int32) for cu in (cu_seqlens_q, cu_seqlens_k))
    max_seqlen_q = _longest(cu_seqlens_q) if max_seqlen_q is None else int(max_seqlen_q)
    max_seqlen_k = _longest(cu_seqlens_k) if max_seqlen_k is None else int(max_seqlen_k)
    return flashattn_ext.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                max_seqlen_k, **options)


def _longest(cu_seqlens) -> int:
    return int(cu_seqlens.diff().max()) if cu_seqlens.numel() > 1 else 0
