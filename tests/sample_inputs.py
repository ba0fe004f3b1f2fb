"""The named attention cases shared by the correctness, gradient, opcheck and
compile tests (one list, as extension-cpp's sample_inputs), and the
variable-length ones (VARLEN_CASES) shared by test_varlen, opcheck and compile.

Sizes are small because the CPU kernel is real but runs on 2 cores in CI; the
sequence lengths are chosen around the CPU kernel's 128 x 128 blocks
(kBlockQ/kBlockK in csrc/cpu/attention_cpu.cpp): 1, 17, 127, 129, 257, and
seqlen_q != seqlen_k both ways.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch

# kBlockQ = kBlockK in csrc/cpu/attention_cpu.cpp.
CPU_BLOCK = 128

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

# The ops' sequence arguments of a dense call, their schema defaults.
DENSE_SEQUENCE_ARGS = (None, None, None, None, -1, -1)


def make_sink(wanted: bool, nheads: int, gen: torch.Generator, device, requires_grad: bool):
    """A learnable_sink (fp32 (nheads,)) of logits around the scores' size, or None."""
    if not wanted:
        return None
    return (torch.randn(nheads, generator=gen) + 1.0).to(device).requires_grad_(requires_grad)


def alibi_slopes_for(nheads: int) -> torch.Tensor:
    """The standard ALiBi slopes 2^(-8 (h + 1) / nheads), fp32 (nheads,)."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / nheads) for h in range(nheads)], dtype=torch.float32)


def make_alibi_slopes(kind: Optional[str], batch: int, nheads: int, gen: torch.Generator, device):
    """None; "nheads": the standard slopes, (nheads,); "batch_nheads": random slopes in
    [0.05, 0.55), one row per batch entry."""
    if kind == "nheads":
        return alibi_slopes_for(nheads).to(device)
    if kind == "batch_nheads":
        return (torch.rand(batch, nheads, generator=gen) * 0.5 + 0.05).to(device)
    return None


@dataclass
class AttentionInputs:
    """Tensors and arguments of one call, ready for flash_attn_func or the ops."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    softmax_scale: Optional[float]
    causal: bool
    window: Tuple[int, int]
    softcap: float
    alibi_slopes: Optional[torch.Tensor]
    # The ops' arguments after `deterministic`: (cu_seqlens_q, cu_seqlens_k, seqused_q,
    # seqused_k, max_seqlen_q, max_seqlen_k); empty for a dense call.
    sequence_args: tuple = ()
    learnable_sink: Optional[torch.Tensor] = None

    def func_kwargs(self) -> dict:
        """Keyword arguments of flash_attn_func (flash-attn names)."""
        return dict(softmax_scale=self.softmax_scale, causal=self.causal, window_size=self.window,
                    softcap=self.softcap, alibi_slopes=self.alibi_slopes,
                    learnable_sink=self.learnable_sink)

    def reference_kwargs(self) -> dict:
        return dict(softmax_scale=self.softmax_scale, causal=self.causal, window=self.window,
                    softcap=self.softcap, alibi_slopes=self.alibi_slopes,
                    learnable_sink=self.learnable_sink)

    def differentiable(self) -> tuple:
        """The inputs that get gradients: q, k, v and the sink where there is one."""
        return (self.q, self.k, self.v) + ((self.learnable_sink,) if self.learnable_sink is not None else ())

    def resolved_scale(self) -> float:
        return self.softmax_scale if self.softmax_scale is not None else self.q.size(-1) ** -0.5

    def _trailing_op_args(self) -> tuple:
        """The ops' arguments after `deterministic`, as short as the call allows."""
        if self.learnable_sink is None:
            return self.sequence_args
        return (self.sequence_args or DENSE_SEQUENCE_ARGS) + (self.learnable_sink,)

    def forward_op_args(self, deterministic: bool = False) -> tuple:
        """Positional arguments of torch.ops.flashattn_ext.attention_forward (deterministic: the
        backward autograd runs for it)."""
        args = (self.q, self.k, self.v, self.resolved_scale(), self.causal, self.window[0],
                self.window[1], self.softcap, self.alibi_slopes, 0.0, None)
        trailing = self._trailing_op_args()
        return args + ((deterministic, *trailing) if trailing or deterministic else ())

    def backward_op_args(self, out: torch.Tensor, lse: torch.Tensor, deterministic: bool = False) -> tuple:
        """Positional arguments of torch.ops.flashattn_ext.attention_backward."""
        return (self.dout, self.q, self.k, self.v, out, lse, self.resolved_scale(), self.causal,
                self.window[0], self.window[1], self.softcap, self.alibi_slopes, 0.0, None,
                deterministic, *self._trailing_op_args())


@dataclass(frozen=True)
class AttentionCase:
    name: str
    batch: int = 2
    seqlen_q: int = 17
    seqlen_k: int = 17
    nheads: int = 2
    nheads_kv: int = 2
    head_dim: int = 32
    causal: bool = False
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    # None, "nheads" (shape (nheads,)) or "batch_nheads" (shape (batch, nheads)).
    alibi: Optional[str] = None
    softmax_scale: Optional[float] = None
    # A learnable_sink (fp32, (nheads,)).
    sink: bool = False
    # "contiguous"; "mixed_strides": q a slice of a packed qkv tensor, k stored
    # head-major, v stored seqlen-major, dout stored head-major (every tensor a
    # different layout, so a kernel reading one tensor with another's strides
    # fails); "expanded_kv_heads": k and v broadcast over heads (stride 0).
    layout: str = "contiguous"
    tags: Tuple[str, ...] = field(default=())

    def __str__(self) -> str:
        return self.name

    @property
    def op_compatible(self) -> bool:
        """Whether the op itself accepts the case (flash_attn_func pads other head dims)."""
        return self.head_dim % 8 == 0

    def make(self, dtype: torch.dtype = torch.float32, device="cpu", requires_grad: bool = False,
             seed: int = 0) -> AttentionInputs:
        gen = torch.Generator().manual_seed(seed)
        b, sq, sk, h, hk, d = (self.batch, self.seqlen_q, self.seqlen_k, self.nheads,
                               self.nheads_kv, self.head_dim)

        def randn(*shape):
            # Drawn in fp32 on the CPU so every dtype and device sees the same values.
            return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

        if self.layout == "contiguous":
            q, k, v = randn(b, sq, h, d), randn(b, sk, hk, d), randn(b, sk, hk, d)
            dout = randn(b, sq, h, d)
        elif self.layout == "mixed_strides":
            q = randn(b, sq, 3, h, d)[:, :, 1]
            k = randn(b, hk, sk, d).transpose(1, 2)
            v = randn(sk, hk, b, d).permute(2, 0, 1, 3)
            dout = randn(b, h, sq, d).transpose(1, 2)
        elif self.layout == "expanded_kv_heads":
            q = randn(b, sq, h, d)
            k = randn(b, sk, 1, d).expand(b, sk, hk, d)
            v = randn(b, sk, 1, d).expand(b, sk, hk, d)
            dout = randn(b, sq, h, d)
        else:
            raise ValueError(f"unknown layout {self.layout}")
        for t in (q, k, v):
            t.requires_grad_(requires_grad)

        alibi_slopes = make_alibi_slopes(self.alibi, b, h, gen, device)
        return AttentionInputs(q, k, v, dout, self.softmax_scale, self.causal, self.window,
                               self.softcap, alibi_slopes,
                               learnable_sink=make_sink(self.sink, h, gen, device, requires_grad))


CASES = [
    AttentionCase("basic", batch=2, seqlen_q=17, seqlen_k=17, nheads=2, head_dim=32, tags=("opcheck", "compile")),
    AttentionCase("seqlen_1", batch=2, seqlen_q=1, seqlen_k=1, nheads=2, head_dim=16, tags=("opcheck",)),
    AttentionCase("block_minus_1_causal", batch=1, seqlen_q=CPU_BLOCK - 1, seqlen_k=CPU_BLOCK - 1,
                  causal=True),
    AttentionCase("block_plus_1", batch=1, seqlen_q=CPU_BLOCK + 1, seqlen_k=CPU_BLOCK + 1,
                  nheads=2, nheads_kv=1),
    AttentionCase("three_blocks_causal", batch=1, seqlen_q=2 * CPU_BLOCK + 1,
                  seqlen_k=2 * CPU_BLOCK + 1, nheads=1, nheads_kv=1, head_dim=16, causal=True),
    AttentionCase("q1_k239", batch=2, seqlen_q=1, seqlen_k=239),
    AttentionCase("q1_k239_causal", batch=2, seqlen_q=1, seqlen_k=239, causal=True),
    AttentionCase("q239_k1", batch=1, seqlen_q=239, seqlen_k=1),
    # Bottom-right alignment: only the last query row sees the key.
    AttentionCase("q239_k1_causal", batch=1, seqlen_q=239, seqlen_k=1, causal=True, tags=("opcheck",)),
    AttentionCase("q113_k203_causal_gqa", batch=1, seqlen_q=113, seqlen_k=203, nheads=4, nheads_kv=2,
                  head_dim=64, causal=True, tags=("opcheck",)),
    # Rows 0..89 see no key: out 0, lse +inf.
    AttentionCase("q203_k113_causal", batch=1, seqlen_q=203, seqlen_k=113, head_dim=64, causal=True),
    AttentionCase("gqa_2", batch=2, seqlen_q=33, seqlen_k=47, nheads=4, nheads_kv=2),
    AttentionCase("mqa_8_causal", batch=1, seqlen_q=65, seqlen_k=65, nheads=8, nheads_kv=1, causal=True,
                  tags=("compile",)),
    AttentionCase("window_32_16", batch=1, seqlen_q=150, seqlen_k=150, window=(32, 16), tags=("opcheck",)),
    AttentionCase("window_left_only", batch=1, seqlen_q=140, seqlen_k=200, nheads=2, nheads_kv=1,
                  window=(20, -1)),
    AttentionCase("window_right_only", batch=1, seqlen_q=90, seqlen_k=60, window=(-1, 5)),
    AttentionCase("window_diagonal_only", batch=1, seqlen_q=33, seqlen_k=33, head_dim=16, window=(0, 0)),
    # seqlen_q > seqlen_k with right bound 0: rows 0..31 see no key.
    AttentionCase("window_masks_rows", batch=1, seqlen_q=64, seqlen_k=32, window=(8, 0), tags=("opcheck",)),
    AttentionCase("causal_window", batch=1, seqlen_q=130, seqlen_k=130, causal=True, window=(16, -1)),
    AttentionCase("softcap", batch=2, seqlen_q=40, seqlen_k=40, softcap=2.0, softmax_scale=0.5,
                  tags=("opcheck",)),
    AttentionCase("softcap_causal_gqa", batch=1, seqlen_q=70, seqlen_k=90, nheads=4, nheads_kv=2,
                  causal=True, softcap=1.5, softmax_scale=0.4),
    AttentionCase("alibi_per_head_causal", batch=2, seqlen_q=50, seqlen_k=50, nheads=4, nheads_kv=4,
                  causal=True, alibi="nheads", tags=("opcheck",)),
    AttentionCase("alibi_per_batch_head", batch=2, seqlen_q=37, seqlen_k=61, nheads=4, nheads_kv=2,
                  alibi="batch_nheads", tags=("opcheck",)),
    AttentionCase("all_features", batch=1, seqlen_q=150, seqlen_k=131, nheads=4, nheads_kv=2, causal=True,
                  window=(40, -1), softcap=3.0, alibi="batch_nheads", softmax_scale=0.3,
                  tags=("opcheck", "compile")),
    AttentionCase("mixed_strides", batch=2, seqlen_q=45, seqlen_k=45, nheads=4, nheads_kv=2,
                  layout="mixed_strides", tags=("opcheck", "compile")),
    # Learnable sinks: alone, and with every other modifier; rows 0..19 of the causal case
    # see no key and get out 0, lse = sink.
    AttentionCase("sink", batch=2, seqlen_q=17, seqlen_k=17, sink=True, tags=("opcheck", "compile")),
    AttentionCase("sink_causal_q_gt_k", batch=1, seqlen_q=40, seqlen_k=20, nheads=2, causal=True, sink=True,
                  tags=("opcheck",)),
    AttentionCase("sink_window_gqa_two_blocks", batch=1, seqlen_q=CPU_BLOCK + 9, seqlen_k=CPU_BLOCK + 20,
                  nheads=4, nheads_kv=2, window=(30, 10), sink=True),
    AttentionCase("sink_all_features", batch=1, seqlen_q=70, seqlen_k=61, nheads=4, nheads_kv=2, causal=True,
                  window=(40, -1), softcap=3.0, alibi="batch_nheads", softmax_scale=0.3, sink=True,
                  layout="mixed_strides", tags=("opcheck", "compile")),
    AttentionCase("mixed_strides_causal", batch=1, seqlen_q=130, seqlen_k=70, nheads=2, nheads_kv=1,
                  head_dim=64, causal=True, layout="mixed_strides"),
    AttentionCase("expanded_kv_heads", batch=1, seqlen_q=40, seqlen_k=40, nheads=4, nheads_kv=4,
                  layout="expanded_kv_heads"),
    AttentionCase("head_dim_8", batch=1, seqlen_q=30, seqlen_k=30, head_dim=8),
    AttentionCase("head_dim_72", batch=1, seqlen_q=30, seqlen_k=50, head_dim=72),
    AttentionCase("head_dim_128_causal", batch=1, seqlen_q=70, seqlen_k=70, head_dim=128, causal=True),
    AttentionCase("head_dim_256", batch=1, seqlen_q=40, seqlen_k=60, head_dim=256, tags=("opcheck",)),
    # Not multiples of 8: flash_attn_func pads them (the op alone refuses them).
    AttentionCase("head_dim_59_padded", batch=1, seqlen_q=30, seqlen_k=30, head_dim=59, tags=("compile",)),
    AttentionCase("head_dim_3_padded_causal", batch=2, seqlen_q=20, seqlen_k=25, head_dim=3, causal=True),
]

CASES_BY_NAME = {case.name: case for case in CASES}
assert len(CASES_BY_NAME) == len(CASES), "case names must be unique"


def cases_tagged(tag: str):
    return [case for case in CASES if tag in case.tags]


# gradcheck perturbs every input element: tiny shapes, fp64, through
# flash_attn_func and the real CPU op. Expanded (stride-0) inputs are left out:
# perturbing one element there perturbs every alias of it.
GRADCHECK_CASES = [
    AttentionCase("gc_basic", batch=1, seqlen_q=5, seqlen_k=5, nheads=2, nheads_kv=2, head_dim=8),
    AttentionCase("gc_gqa_causal_q_gt_k", batch=1, seqlen_q=7, seqlen_k=4, nheads=4, nheads_kv=2,
                  head_dim=8, causal=True),
    AttentionCase("gc_causal_q_lt_k", batch=2, seqlen_q=3, seqlen_k=6, nheads=1, nheads_kv=1,
                  head_dim=8, causal=True),
    AttentionCase("gc_window", batch=1, seqlen_q=6, seqlen_k=8, nheads=2, nheads_kv=1, head_dim=8,
                  window=(2, 1)),
    AttentionCase("gc_softcap", batch=1, seqlen_q=5, seqlen_k=6, nheads=2, nheads_kv=2, head_dim=8,
                  softcap=1.5, softmax_scale=0.7),
    AttentionCase("gc_alibi", batch=2, seqlen_q=4, seqlen_k=6, nheads=2, nheads_kv=2, head_dim=8,
                  causal=True, alibi="batch_nheads"),
    AttentionCase("gc_mqa_all_features", batch=1, seqlen_q=6, seqlen_k=5, nheads=3, nheads_kv=1,
                  head_dim=8, window=(3, 0), softcap=2.0, alibi="nheads"),
    AttentionCase("gc_mixed_strides", batch=1, seqlen_q=5, seqlen_k=5, nheads=2, nheads_kv=1,
                  head_dim=8, layout="mixed_strides"),
    AttentionCase("gc_head_dim_5_padded", batch=1, seqlen_q=4, seqlen_k=6, nheads=1, nheads_kv=1,
                  head_dim=5, causal=True),
]

# Zero-sized problems: out (and the gradients) are empty or zero, never garbage.
EMPTY_CASES = [
    AttentionCase("empty_batch", batch=0, seqlen_q=5, seqlen_k=7, nheads=2, nheads_kv=1, head_dim=16),
    AttentionCase("empty_seqlen_q", batch=2, seqlen_q=0, seqlen_k=7, nheads=2, nheads_kv=1, head_dim=16),
    AttentionCase("empty_seqlen_k", batch=2, seqlen_q=5, seqlen_k=0, nheads=2, nheads_kv=1, head_dim=16),
    AttentionCase("empty_seqlen_k_causal_padded", batch=1, seqlen_q=3, seqlen_k=0, head_dim=12, causal=True),
]


def poison_unused_rows(t: torch.Tensor, lengths, used, dense: bool) -> None:
    """NaN in the rows of each sequence past its `used` ones (a varlen tensor's rows in order,
    or a dense one's per batch entry)."""
    start = 0
    for b, (length, count) in enumerate(zip(lengths, used)):
        rows = t[b, count:] if dense else t[start + count:start + length]
        rows.fill_(float("nan"))
        start += length


@dataclass(frozen=True)
class VarlenCase:
    """A batch of sequences of different lengths in flash_attn_varlen_func's layout:
    q (sum(seqlens_q), nheads, head_dim), sequence b at rows cu_seqlens_q[b] ..
    cu_seqlens_q[b + 1], likewise k and v; or a side dense ((batch, seqlen, ...), all its
    lengths equal) with dense_q / dense_k."""

    name: str
    seqlens_q: Tuple[int, ...]
    seqlens_k: Tuple[int, ...]
    nheads: int = 2
    nheads_kv: int = 2
    head_dim: int = 32
    causal: bool = False
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    # None, "nheads" (shape (nheads,)) or "batch_nheads" (one row per sequence).
    alibi: Optional[str] = None
    softmax_scale: Optional[float] = None
    # max_seqlen_q/k exceed the longest sequence by this much (they are only bounds).
    max_seqlen_slack: int = 0
    seqused_q: Optional[Tuple[int, ...]] = None
    seqused_k: Optional[Tuple[int, ...]] = None
    dense_q: bool = False
    dense_k: bool = False
    sink: bool = False
    tags: Tuple[str, ...] = field(default=())

    def __post_init__(self):
        assert len(self.seqlens_q) == len(self.seqlens_k), self.name
        for dense, lengths in ((self.dense_q, self.seqlens_q), (self.dense_k, self.seqlens_k)):
            assert not dense or len(set(lengths)) == 1, f"{self.name}: a dense side has one length"

    def __str__(self) -> str:
        return self.name

    @property
    def batch(self) -> int:
        return len(self.seqlens_q)

    @property
    def op_compatible(self) -> bool:
        return self.head_dim % 8 == 0

    def used_lengths(self) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        """The rows of each sequence that count: seqused where given, else all."""
        return self.seqused_q or self.seqlens_q, self.seqused_k or self.seqlens_k

    def make(self, dtype: torch.dtype = torch.float32, device="cpu", requires_grad: bool = False,
             seed: int = 0) -> AttentionInputs:
        gen = torch.Generator().manual_seed(seed)
        h, hk, d = self.nheads, self.nheads_kv, self.head_dim

        def randn(*shape):
            return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

        def side(lengths, dense, heads):
            return randn(self.batch, lengths[0], heads, d) if dense else randn(sum(lengths), heads, d)

        def int32(values):
            return torch.tensor(values, dtype=torch.int32, device=device)

        def cu_seqlens(lengths, dense):
            return None if dense else int32([0, *itertools.accumulate(lengths)])

        def max_seqlen(lengths, dense):
            return -1 if dense else max(lengths, default=0) + self.max_seqlen_slack

        q, k, v = side(self.seqlens_q, self.dense_q, h), side(self.seqlens_k, self.dense_k, hk), \
            side(self.seqlens_k, self.dense_k, hk)
        dout = side(self.seqlens_q, self.dense_q, h)
        # The rows seqused leaves out can hold anything (torch.empty's NaN and inf included): NaN
        # there shows any kernel that reads them into a sum (0 x NaN is NaN).
        used_q, used_k = self.used_lengths()
        for t in (q, dout):
            poison_unused_rows(t, self.seqlens_q, used_q, self.dense_q)
        for t in (k, v):
            poison_unused_rows(t, self.seqlens_k, used_k, self.dense_k)
        for t in (q, k, v):
            t.requires_grad_(requires_grad)
        alibi_slopes = make_alibi_slopes(self.alibi, self.batch, h, gen, device)
        sequence_args = (cu_seqlens(self.seqlens_q, self.dense_q), cu_seqlens(self.seqlens_k, self.dense_k),
                         None if self.seqused_q is None else int32(self.seqused_q),
                         None if self.seqused_k is None else int32(self.seqused_k),
                         max_seqlen(self.seqlens_q, self.dense_q), max_seqlen(self.seqlens_k, self.dense_k))
        return AttentionInputs(q, k, v, dout, self.softmax_scale, self.causal, self.window, self.softcap,
                               alibi_slopes, sequence_args, make_sink(self.sink, h, gen, device, requires_grad))


# Lengths include 0 and 1, one past the CPU block (129, 130, 140), queries without keys
# and keys without queries; the rows past seqused and the rows that see no key (causal
# with more queries than keys) get out 0, lse +inf and zero gradients.
VARLEN_CASES = [
    VarlenCase("mixed_lengths", seqlens_q=(5, 0, 1, 130, 17), seqlens_k=(5, 0, 1, 130, 17),
               tags=("opcheck", "compile")),
    VarlenCase("q_k_differ_causal", seqlens_q=(3, 40, 1, 0, 129, 2), seqlens_k=(7, 20, 1, 5, 140, 0),
               causal=True, tags=("opcheck",)),
    VarlenCase("max_seqlen_slack", seqlens_q=(4, 9), seqlens_k=(6, 2), max_seqlen_slack=50,
               tags=("opcheck",)),
    VarlenCase("window", seqlens_q=(50, 140, 7), seqlens_k=(60, 130, 7), window=(16, 8)),
    VarlenCase("gqa_causal_window_left", seqlens_q=(33, 1, 70), seqlens_k=(33, 12, 90), nheads=4,
               nheads_kv=2, causal=True, window=(10, -1)),
    VarlenCase("mqa", seqlens_q=(20, 9), seqlens_k=(31, 9), nheads=4, nheads_kv=1, head_dim=64),
    VarlenCase("softcap_causal", seqlens_q=(20, 0, 35), seqlens_k=(25, 3, 35), causal=True, softcap=2.0,
               softmax_scale=0.5),
    VarlenCase("alibi_per_sequence_gqa", seqlens_q=(10, 37, 1), seqlens_k=(20, 30, 8), nheads=4,
               nheads_kv=2, causal=True, alibi="batch_nheads", tags=("opcheck",)),
    VarlenCase("alibi_per_head", seqlens_q=(12, 30), seqlens_k=(40, 30), alibi="nheads"),
    VarlenCase("seqused_causal", seqlens_q=(10, 20, 0, 5), seqlens_k=(12, 20, 3, 5), seqused_q=(10, 7, 0, 0),
               seqused_k=(12, 3, 0, 5), causal=True, tags=("opcheck", "compile")),
    VarlenCase("varlen_q_dense_k_causal", seqlens_q=(5, 0, 17), seqlens_k=(23, 23, 23), dense_k=True,
               causal=True, tags=("opcheck",)),
    VarlenCase("dense_seqused", seqlens_q=(19, 19), seqlens_k=(21, 21), seqused_q=(19, 4), seqused_k=(0, 9),
               dense_q=True, dense_k=True, tags=("opcheck",)),
    VarlenCase("head_dim_20_padded", seqlens_q=(3, 17), seqlens_k=(3, 17), head_dim=20, causal=True),
    # Sequences out of length order, with ties: the forward grids take them longest first.
    VarlenCase("unsorted_lengths_ties", seqlens_q=(70, 3, 200, 0, 70, 129, 1, 64, 300, 17, 65, 200),
               seqlens_k=(70, 3, 200, 0, 70, 129, 1, 64, 300, 17, 65, 200), nheads=2, causal=True),
    VarlenCase("sink_causal_seqused_gqa", seqlens_q=(9, 0, 30, 6), seqlens_k=(4, 3, 140, 0), nheads=4,
               nheads_kv=2, causal=True, seqused_q=(9, 0, 25, 6), sink=True, tags=("opcheck",)),
]

VARLEN_CASES_BY_NAME = {case.name: case for case in VARLEN_CASES}
assert len(VARLEN_CASES_BY_NAME) == len(VARLEN_CASES), "case names must be unique"


@dataclass
class PagedKeys:
    """A varlen call's keys and values in flash-attn's paged layout (flash_attn_varlen_func's
    block_table): k_cache, v_cache (num_blocks, page_size, nheads_kv, head_dim), block_table
    int32 (batch, max_blocks_per_seq), and rows[t], the row of cache.flatten(0, 1) that holds
    packed key row t."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    rows: torch.Tensor

    def packed(self, cache_like: torch.Tensor) -> torch.Tensor:
        """A tensor shaped like the caches (a gradient), in the packed key layout."""
        return cache_like.flatten(0, 1)[self.rows]

    def rows_holding_no_key(self, cache_like: torch.Tensor) -> torch.Tensor:
        held = torch.zeros(cache_like.size(0) * cache_like.size(1), dtype=torch.bool, device=cache_like.device)
        held[self.rows] = True
        return cache_like.flatten(0, 1)[~held]


def paged_keys(k: torch.Tensor, v: torch.Tensor, seqlens_k, page_size: int, seed: int = 0,
               requires_grad: bool = False) -> PagedKeys:
    """k, v (total_k, nheads_kv, head_dim), sequences of lengths seqlens_k, moved into pages of
    page_size rows: the pages in shuffled order beside two that no sequence uses, and each
    table row one entry longer than its sequence needs. The cache rows that hold no key are
    NaN and the table's entries past a sequence's pages out of range (-1, num_blocks + 7):
    reading either would show."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-length // page_size) for length in seqlens_k]
    num_blocks = sum(pages) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(seqlens_k), max(pages, default=0) + 1), num_blocks + 7, dtype=torch.int32)
    table[::2, -1] = -1
    rows = []
    for b, length in enumerate(seqlens_k):
        for page in range(pages[b]):
            table[b, page] = order.pop()
        rows += [int(table[b, r // page_size]) * page_size + r % page_size for r in range(length)]
    rows = torch.tensor(rows, dtype=torch.long, device=k.device)
    caches = []
    for t in (k.detach(), v.detach()):
        cache = torch.full((num_blocks, page_size, *t.shape[1:]), float("nan"), dtype=t.dtype, device=t.device)
        cache.flatten(0, 1)[rows] = t
        caches.append(cache.requires_grad_(requires_grad))
    return PagedKeys(*caches, table.to(k.device), rows)
