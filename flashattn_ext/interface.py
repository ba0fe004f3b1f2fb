"""flash-attn 2.x compatible functions: flash_attn_func, flash_attn_qkvpacked_func,
flash_attn_kvpacked_func, their variable-length forms flash_attn_varlen_func,
flash_attn_varlen_qkvpacked_func, flash_attn_varlen_kvpacked_func, and the inference
function flash_attn_with_kvcache (append to a KV cache in place, then attend to it).

Same argument names, defaults and return conventions as flash-attn 2.x; layout
(batch, seqlen, nheads, head_dim), or (total, nheads, head_dim) for the varlen
functions, whose sequence b is rows cu_seqlens[b] .. cu_seqlens[b + 1] (int32,
batch + 1 entries); MQA/GQA when nheads of k/v divides that of q; causal with
seqlen_q != seqlen_k aligned bottom-right (flash-attn >= 2.1), per sequence in
the varlen functions (as are the sliding window and ALiBi).

Strides: every stride but the last goes to the kernel as given (no copy), so
slices of a packed qkv tensor, transposed storage and expanded heads all run in
place. q, k or v is copied once, as in flash-attn, when its last dimension is
not contiguous, or when its head dim is not a multiple of 8 (it is then padded
with zeros to the next multiple, which the op requires, and the output is
sliced back).

Additions to flash-attn 2.x, keyword-only after its arguments:

* ``learnable_sink`` (FlashAttention-4's learnable_sink, gpt-oss's sinks): fp32
  ``(nheads,)``, one logit per query head that joins every row's softmax denominator
  (it takes probability mass and contributes no value), with a gradient. The returned
  softmax_lse includes it, and a row that sees no key gets out = 0, lse = sink.

Dropout (``dropout_p > 0``, flash-attn 2.x semantics: each probability kept with
probability 1 - dropout_p and scaled by 1 / (1 - dropout_p); softmax_lse is that of the
undropped probabilities). Each call draws a fresh seed from torch's generator of q's
device, so ``torch.manual_seed`` reproduces a call bit for bit and consecutive calls get
different masks; the mask is a function of the seed and the element's position, so the
backward regenerates it and it does not depend on the thread count or the backend (the
CPU and CUDA kernels compute the same function, csrc/common/philox.h). dropout_p is
applied rounded to a multiple of 1/256, as in flash-attn 2's kernels (each element's byte
decides it; the kept ones are still scaled by exactly 1 / (1 - dropout_p)).

Differences from flash-attn, all deliberate:

* ``return_attn_probs=True`` returns ``(out, softmax_lse, S_dmask)`` as flash-attn does,
  S_dmask None without dropout (as flash-attn 2: callers that want softmax_lse pay
  nothing more). With dropout it is for testing only (it forms the N x N matrix; on CUDA
  the CPU backend computes it, so it cannot be captured in a CUDA graph):
  S_dmask (batch, nheads, seqlen_q, seqlen_k) in q's dtype, each seqlen the longest
  sequence rounded up to a multiple of 128, holds P = exp(S - softmax_lse) where a key
  is visible, 0 elsewhere, and -P where dropout dropped the element (flash-attn's
  encoding: ``S_dmask >= 0`` is the kept pattern).
* The returned softmax_lse has no gradient: a loss that depends on it gets
  none through it (as in flash-attn, whose backward ignores it too).
* A row that sees no key (possible with a sliding window, or causal with
  seqlen_q > seqlen_k) gets out = 0 and lse = +inf (lse = sink with a learnable_sink).
* flash_attn_varlen_func also takes FA3's keyword-only seqused_q / seqused_k
  (int32, (batch,)): only the first seqused[b] rows of sequence b count; the rows
  past them get out = 0, lse = +inf and zero gradients. Its block_table takes paged
  keys and values (flashattn_ext/paged_kv.py).
* Devices: CPU (fp32, fp64, bf16, fp16; every feature) and CUDA (fp16, bf16) where
  the build has the CUDA kernels.
  flash_attn_with_kvcache runs on the CPU and on CUDA; it takes no head dim that is not a
  multiple of 8 (padding would copy the cache it must write in place).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

from . import checks
from . import ops
from . import paged_kv


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def _kernel_operand(t: torch.Tensor, padded_head_dim: int) -> torch.Tensor:
    """t in the layout the op takes: head dim a multiple of 8 and unit-stride.
    At most one copy: padding with zero columns (which change neither q·k nor
    the output's first head_dim columns) also makes the head dim unit-stride."""
    if t.size(-1) != padded_head_dim:
        return F.pad(t, [0, padded_head_dim - t.size(-1)])
    return ops.unit_stride_last_dim(t)


def _kernel_operands(q, k, v, layout: checks.SequenceLayout = checks.DENSE):
    """q, k, v in the op's layout (see _kernel_operand); slice the output back to
    q.size(-1) columns. Only operands the op could take once padded are padded (the
    ranks of the layout, one head dim within the op's limit): any other call goes to
    the op as given, so that its checks report the caller's own shapes."""
    ranks = (3 if layout.varlen_q else 4, 3 if layout.varlen_k else 4, 3 if layout.varlen_k else 4)
    if (tuple(t.dim() for t in (q, k, v)) != ranks or not q.size(-1) == k.size(-1) == v.size(-1)
            or q.size(-1) > checks.MAX_HEAD_DIM):
        return q, k, v
    padded = _round_up(q.size(-1), checks.HEAD_DIM_ALIGNMENT)
    return tuple(_kernel_operand(t, padded) for t in (q, k, v))


def _softmax_scale(softmax_scale, head_dim: int) -> float:
    """The scale as given, or 1/sqrt(head_dim) of the head dim the caller gave, not
    the padded one (1 for an empty head dim); the op checks it."""
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5 if head_dim > 0 else 1.0
    return float(softmax_scale)


def _draw_rng_state(device: torch.device) -> torch.Tensor:
    """[seed, offset] (int64) for a dropout call, drawn from torch's generator of
    ``device``: torch.manual_seed makes the mask reproducible, and each call
    advances the generator, so consecutive calls get a fresh seed and different
    masks (the offset stays 0). The backward reuses the same tensor, so it
    regenerates the forward's mask (csrc/common/philox.h)."""
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)
    offset = torch.zeros(1, dtype=torch.int64, device=device)
    return torch.cat([seed, offset])


def _check_tensor_arguments(q, k, v, alibi_slopes, learnable_sink) -> None:
    """Tensors where the functions read tensor attributes before the op sees them."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        checks.check_is_tensor(t, name)
    for t, name in ((alibi_slopes, "alibi_slopes"), (learnable_sink, "learnable_sink")):
        if t is not None:
            checks.check_is_tensor(t, name)


def _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
               deterministic, return_attn_probs, learnable_sink,
               layout: checks.SequenceLayout = checks.DENSE):
    """Every public function: one forward op call (whose autograd formula is registered
    in ops.py, and whose C++ checks see every argument) on the operands in its layout."""
    _check_tensor_arguments(q, k, v, alibi_slopes, learnable_sink)
    window_left, window_right = checks.check_window_size(window_size)
    head_dim = q.size(-1) if q.dim() > 0 else 0
    softmax_scale = _softmax_scale(softmax_scale, head_dim)
    dropout_p = float(dropout_p)
    softcap = float(softcap)

    rng_state = _draw_rng_state(q.device) if dropout_p > 0.0 else None

    q_op, k_op, v_op = _kernel_operands(q, k, v, layout)
    out, lse = ops.attention_forward(q_op, k_op, v_op, softmax_scale, bool(causal), window_left, window_right,
                                     softcap, alibi_slopes, dropout_p, rng_state, bool(deterministic),
                                     *layout.op_args(), learnable_sink)
    out = out[..., :head_dim]
    if return_attn_probs:
        probs = None
        if dropout_p > 0.0:
            with torch.no_grad():
                probs = ops.attention_probabilities(q_op, k_op, lse, softmax_scale, bool(causal), window_left,
                                                    window_right, softcap, alibi_slopes, dropout_p, rng_state,
                                                    *layout.op_args())
        return out, lse, probs
    return out


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: Optional[torch.Tensor] = None,
):
    """Exact attention softmax(q·kᵀ·scale + bias)·v without materialising the scores.

    Arguments:
        q: (batch, seqlen_q, nheads, head_dim)
        k, v: (batch, seqlen_k, nheads_kv, head_dim); nheads % nheads_kv == 0 (MQA/GQA).
            head_dim <= 256; one not a multiple of 8 is zero-padded internally.
        dropout_p: dropout probability in [0, 1). Pass 0.0 at evaluation. Each call
            draws its mask from torch's generator (see the module docstring).
        softmax_scale: scale of q·kᵀ; default 1/sqrt(head_dim).
        causal: causal mask aligned to the bottom-right corner of the score matrix.
        window_size: (left, right) sliding window; -1 means unbounded. Query i sees
            key j iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right.
        softcap: > 0 applies softcap·tanh(score / softcap) before the bias.
        alibi_slopes: fp32 (nheads,) or (batch, nheads); adds -slope·|i + seqlen_k - seqlen_q - j|.
        deterministic: deterministic backward (the CPU backward always is).
        return_attn_probs: also return softmax_lse and flash-attn's S_dmask, for testing
            (see the module docstring).
        learnable_sink (keyword only): fp32 (nheads,) sink logits, one per query head,
            that join each row's softmax denominator; differentiable.

    Returns:
        out (batch, seqlen_q, nheads, head_dim); with return_attn_probs,
        (out, softmax_lse (batch, nheads, seqlen_q) fp32 (fp64 for fp64 inputs), S_dmask).
    """
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs, learnable_sink)


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: Optional[torch.Tensor] = None,
):
    """flash_attn_func on qkv (batch, seqlen, 3, nheads, head_dim).

    q, k and v are read in place as strided slices of qkv (no copy); the
    gradient comes back as one tensor of qkv's shape.
    """
    checks.check_packed(qkv, "qkv", 3, "(batch, seqlen, 3, nheads, head_dim)")
    q, k, v = qkv.unbind(dim=2)
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs, learnable_sink)


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: Optional[torch.Tensor] = None,
):
    """flash_attn_func on q (batch, seqlen_q, nheads, head_dim) and
    kv (batch, seqlen_k, 2, nheads_kv, head_dim); k and v are strided slices of kv."""
    checks.check_is_tensor(q, "q")
    checks.check_packed(kv, "kv", 2, "(batch, seqlen_k, 2, nheads_kv, head_dim)")
    k, v = kv.unbind(dim=2)
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs, learnable_sink)


def _varlen_layout(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                   seqused_k=None) -> checks.SequenceLayout:
    """The sequence arguments of a varlen function, type-checked (the op checks the rest)."""
    checks.check_is_tensor(cu_seqlens_q, "cu_seqlens_q")
    checks.check_is_tensor(cu_seqlens_k, "cu_seqlens_k")
    return checks.SequenceLayout(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                                 checks.check_int(max_seqlen_q, "max_seqlen_q"),
                                 checks.check_int(max_seqlen_k, "max_seqlen_k"))


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Optional[torch.Tensor] = None,
    *,
    seqused_q: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    learnable_sink: Optional[torch.Tensor] = None,
):
    """flash_attn_func on a batch of sequences of different lengths, concatenated.

    Arguments:
        q: (total_q, nheads, head_dim), sequence b at rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1].
        k, v: (total_k, nheads_kv, head_dim), likewise with cu_seqlens_k.
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,), starting at 0, non-decreasing,
            ending at total_q / total_k.
        max_seqlen_q, max_seqlen_k: at least the longest query / key sequence.
        block_table: int32 (batch, max_blocks_per_seq), paged keys and values (flash-attn
            2.x's layout): k, v (num_blocks, page_size, nheads_kv, head_dim), any page_size;
            key row r of sequence b in block block_table[b][r // page_size], row
            r % page_size, sequence b's length cu_seqlens_k[b + 1] - cu_seqlens_k[b] (or
            seqused_k[b]). A decoding step (one query row per sequence, no gradient,
            dropout or ALiBi) reads the pages in place (flash_attn_with_kvcache's kernel);
            otherwise the rows a call reads are gathered into one copy first
            (flashattn_ext/paged_kv.py), differentiable, the gradients reaching the pages.
        seqused_q, seqused_k (keyword only, as FA3): int32 (batch,); only the first
            seqused[b] rows of sequence b are used, the others get out = 0, lse = +inf and
            zero gradients.
        The other arguments as flash_attn_func; causal, the window and ALiBi distances
        use each sequence's own lengths, and alibi_slopes (batch, nheads) has one row per
        sequence.

    Returns:
        out (total_q, nheads, head_dim); with return_attn_probs,
        (out, softmax_lse (nheads, total_q) fp32 (fp64 for fp64 inputs), S_dmask).
    """
    layout = _varlen_layout(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                            seqused_k)
    if block_table is not None:
        _check_tensor_arguments(q, k, v, alibi_slopes, learnable_sink)
        lengths = paged_kv.checked_lengths(q, k, v, cu_seqlens_q, cu_seqlens_k, layout.max_seqlen_k, seqused_k,
                                           block_table)
        if paged_kv.decodes_in_place(q, k, v, cu_seqlens_q, layout.max_seqlen_q, seqused_q, float(dropout_p),
                                     learnable_sink):
            window_left, window_right = checks.check_window_size(window_size)
            out, lse = paged_kv.decode(q, k, v, lengths, block_table, _softmax_scale(softmax_scale, q.size(-1)),
                                       bool(causal), window_left, window_right, float(softcap), alibi_slopes,
                                       learnable_sink)
            return (out, lse, None) if return_attn_probs else out
        k, v = paged_kv.gather_pages(k, v, lengths, layout.max_seqlen_k, block_table)
        layout = checks.SequenceLayout(cu_seqlens_q, None, seqused_q, lengths, layout.max_seqlen_q, -1)
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs, learnable_sink, layout)


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: Optional[torch.Tensor] = None,
):
    """flash_attn_varlen_func on qkv (total, 3, nheads, head_dim), one cu_seqlens and
    max_seqlen for queries and keys; q, k and v are strided slices of qkv."""
    checks.check_packed(qkv, "qkv", 3, "(total, 3, nheads, head_dim)", packed_dim=1)
    q, k, v = qkv.unbind(dim=1)
    layout = _varlen_layout(cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs, learnable_sink, layout)


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: Optional[torch.Tensor] = None,
):
    """flash_attn_varlen_func on q (total_q, nheads, head_dim) and
    kv (total_k, 2, nheads_kv, head_dim); k and v are strided slices of kv."""
    checks.check_is_tensor(q, "q")
    checks.check_packed(kv, "kv", 2, "(total_k, 2, nheads_kv, head_dim)", packed_dim=1)
    k, v = kv.unbind(dim=1)
    layout = _varlen_layout(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs, learnable_sink, layout)


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Optional[torch.Tensor] = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    learnable_sink: Optional[torch.Tensor] = None,
):
    """Incremental decoding: appends k, v to the KV cache in place, then attends to the cache.

    flash-attn 2.x's function, same arguments and semantics; no backward (a backward
    through out raises).

    Arguments:
        q: (batch, seqlen_q, nheads, head_dim); head_dim a multiple of 8, at most 256.
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_kv, head_dim), or with
            block_table, paged: (num_blocks, page_size, nheads_kv, head_dim), page_size a
            multiple of 16. Written in place (only the new rows); never copied, so their
            last dimension must be contiguous.
        k, v: (batch, seqlen_new, nheads_kv, head_dim), optional, together: written into
            the cache at rows cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 of
            batch entry b's cache row (k rotated first with rotary_cos / rotary_sin).
        rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2), q's dtype, optional (need k):
            rotary embedding of the first rotary_dim columns, at the cache row's position:
            k row t at cache_seqlens[b] + t; q row i at cache_seqlens[b] + i when causal or
            windowed, else every q row at cache_seqlens[b].
        cache_seqlens: int, or int32 (batch,): each sequence's length in the cache before
            this call (an int applies to every one). None: every cache row is used whole,
            and k, v must be None.
        cache_batch_idx: int32 (batch,): batch entry b uses cache row cache_batch_idx[b]
            (default b); not with block_table. Duplicate entries with k given: which write
            lands is unspecified.
        cache_leftpad: int32 (batch,): sequence b starts at cache row cache_leftpad[b]
            (default 0); the rows before it are not attended to.
        block_table: int32 (batch, max_blocks_per_seq): row r of sequence b lives in block
            block_table[b][r // page_size], row r % page_size (paged KV cache).
        softmax_scale: scale of q·kᵀ; default 1/sqrt(head_dim).
        causal, window_size: as flash_attn_func, aligned bottom-right on each sequence's
            keys (cache_leftpad[b] .. cache_seqlens[b] + seqlen_new - 1).
        softcap: > 0 applies softcap·tanh(score / softcap).
        rotary_interleaved: True: rotate column pairs (0, 1), (2, 3), ... (GPT-J); False:
            (i, i + rotary_dim / 2) (GPT-NeoX).
        alibi_slopes: fp32 (nheads,) or (batch, nheads): -slope·|i + seqlen_k - seqlen_q - j|
            joins each score, i and j counted within the sequence's keys (from
            cache_leftpad[b]); on CUDA a tile per query head (its slope): no packed GQA.
        num_splits: split the keys into this many parts whose partial results are merged
            by log-sum-exp (1: no split; 0: the backend chooses). Changes the result by
            rounding only. Not applied to long chunks (at least 128 query rows, with
            batch x nheads x ceil(seqlen_q / 128) at least 3/8 of the GPU's SMs) on a
            contiguous cache without cache_batch_idx, cache_leftpad or rotary on Hopper
            GPUs: those run the dense forward kernel, unsplit.
        return_softmax_lse: also return softmax_lse.
        learnable_sink (keyword only): fp32 (nheads,) sink logits, as flash_attn_func's.

    Returns:
        out (batch, seqlen_q, nheads, head_dim); with return_softmax_lse, (out,
        softmax_lse (batch, nheads, seqlen_q) fp32 (fp64 for fp64 inputs)). A row that sees
        no key gets out = 0 and lse = +inf.
    """
    for t, name in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")):
        checks.check_is_tensor(t, name)
    for t, name in ((k, "k"), (v, "v"), (rotary_cos, "rotary_cos"), (rotary_sin, "rotary_sin"),
                    (cache_batch_idx, "cache_batch_idx"), (cache_leftpad, "cache_leftpad"),
                    (block_table, "block_table"), (alibi_slopes, "alibi_slopes"),
                    (learnable_sink, "learnable_sink")):
        if t is not None:
            checks.check_is_tensor(t, name)
    if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = torch.full((q.size(0),), checks.check_int(cache_seqlens, "cache_seqlens"),
                                   dtype=torch.int32, device=q.device)
    window_left, window_right = checks.check_window_size(window_size)
    head_dim = q.size(-1) if q.dim() > 0 else 0
    # q, k and v are read only: copied when their last dimension is strided, as flash-attn does.
    q, k, v = (t if t is None else ops.unit_stride_last_dim(t) for t in (q, k, v))
    out, lse = ops.attention_kvcache_forward(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
        cache_leftpad, block_table, _softmax_scale(softmax_scale, head_dim), bool(causal),
        window_left, window_right, float(softcap), bool(rotary_interleaved), alibi_slopes,
        checks.check_int(num_splits, "num_splits"), learnable_sink)
    return (out, lse) if return_softmax_lse else out
