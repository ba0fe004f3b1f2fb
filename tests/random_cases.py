"""Seeded random cases across the whole feature space, for the tests that the named cases
of sample_inputs.py and kvcache_inputs.py cannot cover combination by combination:
lengths (0, 1, block boundaries, anything), GQA ratios, head dims (padded ones too),
causal, windows, softcap, ALiBi, sinks, seqused, max_seqlen slack, dense sides and pages
for the variable-length function; for flash_attn_with_kvcache the same modifiers with
rotary, leftpad, cache_batch_idx, pages, appends and num_splits.

Also dense batches for flash_attn_func: the same modifiers, the three tensor layouts of
sample_inputs.AttentionCase, deterministic or not, and dropout.

Case i comes from random.Random of its own seed string, so it is the same case on every
machine and run, whatever the others are, and its name spells its features out: a failure
names what to rerun and what was combined.
"""

from __future__ import annotations

import random
from typing import List, Tuple

from kvcache_inputs import KvcacheCase
from sample_inputs import CPU_BLOCK, AttentionCase, VarlenCase

# Key and query block sizes of the kernels (CPU 128; mma.sync 64-128; Hopper 64-192), +-1.
BOUNDARY_LENGTHS = tuple(n + e for n in (16, 64, CPU_BLOCK, 176, 192, 2 * CPU_BLOCK) for e in (-1, 0, 1))
HEAD_DIMS = (32, 64, 128, 8, 16, 40, 72, 96, 160, 192, 256)
PADDED_HEAD_DIMS = (20, 59)  # not multiples of 8: flash_attn_varlen_func pads them


def _length(rng: random.Random, max_len: int) -> int:
    draw = rng.random()
    if draw < 0.15:
        return rng.choice((0, 1, 2))
    if draw < 0.4:
        return rng.choice([n for n in BOUNDARY_LENGTHS if n <= max_len] or [max_len])
    return rng.randint(3, max_len)


def _window(rng: random.Random, max_side: int) -> Tuple[int, int]:
    if rng.random() < 0.7:
        return (-1, -1)
    side = lambda: rng.choice((-1, 0, rng.randint(1, max_side)))  # noqa: E731
    return (side(), side())


def _flag_names(**flags) -> str:
    def spelled(value):
        return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
    return "".join(f"_{name}" if value is True else f"_{name}{spelled(value)}" for name, value in flags.items()
                   if value not in (None, False, 0, 0.0, (-1, -1)))


def _modifiers(rng: random.Random, max_len: int) -> dict:
    """causal, window, softcap, alibi, softmax_scale and sink, each with its own odds."""
    return dict(causal=rng.random() < 0.5, window=_window(rng, 2 * max_len // 3),
                softcap=rng.choice((0.5, 2.0, 7.5, 30.0)) if rng.random() < 0.25 else 0.0,
                alibi=rng.choice(("nheads", "batch_nheads")) if rng.random() < 0.25 else None,
                softmax_scale=round(rng.uniform(0.05, 0.5), 3) if rng.random() < 0.2 else None,
                sink=rng.random() < 0.25)


def _heads(rng: random.Random) -> Tuple[int, int]:
    nheads_kv = rng.choice((1, 2, 3))
    return nheads_kv * rng.choice((1, 2, 4)), nheads_kv


def random_attention_case(index: int, max_len: int) -> Tuple[AttentionCase, dict]:
    """(case, call) number `index` for flash_attn_func: a dense batch with every modifier and
    one of the three tensor layouts; call: the keyword arguments `deterministic` and
    `dropout_p` besides the case's own."""
    rng = random.Random(f"dense-{index}")
    batch = rng.randint(1, 3)
    seqlen_q = _length(rng, max_len)
    seqlen_k = seqlen_q if rng.random() < 0.4 else _length(rng, max_len)
    nheads, nheads_kv = _heads(rng)
    head_dim = rng.choice(HEAD_DIMS + PADDED_HEAD_DIMS)
    layout = rng.choices(("contiguous", "mixed_strides", "expanded_kv_heads"), weights=(6, 3, 1))[0]
    call = dict(deterministic=rng.random() < 0.2,
                dropout_p=rng.choice((0.1, 0.3, 0.6)) if rng.random() < 0.2 else 0.0)
    features = _modifiers(rng, max_len)
    name = (f"dense{index}_b{batch}_q{seqlen_q}_k{seqlen_k}_h{nheads}-{nheads_kv}_d{head_dim}"
            + _flag_names(**features, layout=layout if layout != "contiguous" else None, **call))
    return AttentionCase(name, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=nheads,
                         nheads_kv=nheads_kv, head_dim=head_dim, layout=layout, **features), call


def random_attention_cases(count: int, max_len: int, first: int = 0) -> List[Tuple[AttentionCase, dict]]:
    return [random_attention_case(i, max_len) for i in range(first, first + count)]


def random_varlen_case(index: int, max_len: int) -> Tuple[VarlenCase, dict]:
    """(case, call) number `index`, sequences of at most max_len rows; call: test_varlen's
    check_case's `page_size` (None: packed keys) and `deterministic`."""
    rng = random.Random(f"varlen-{index}")
    batch = rng.randint(1, 5)
    dense_q, dense_k = rng.random() < 0.15, rng.random() < 0.15
    lengths = lambda dense: ([_length(rng, max_len)] * batch if dense  # noqa: E731
                             else [_length(rng, max_len) for _ in range(batch)])
    seqlens_q = lengths(dense_q)
    seqlens_k = seqlens_q if rng.random() < 0.4 and dense_k == dense_q else lengths(dense_k)
    nheads, nheads_kv = _heads(rng)
    head_dim = rng.choice(HEAD_DIMS + PADDED_HEAD_DIMS if not (dense_q or dense_k) else HEAD_DIMS)
    used = lambda seqlens: (tuple(rng.randint(0, n) for n in seqlens)  # noqa: E731
                            if rng.random() < 0.2 else None)
    paged = not (dense_q or dense_k) and rng.random() < 0.25
    features = dict(
        _modifiers(rng, max_len),
        max_seqlen_slack=rng.randint(1, 40) if rng.random() < 0.2 and not (dense_q or dense_k) else 0,
        seqused_q=used(seqlens_q), seqused_k=used(seqlens_k), dense_q=dense_q, dense_k=dense_k)
    call = dict(page_size=rng.choice((1, 5, 16, 64)) if paged else None, deterministic=rng.random() < 0.2)
    name = (f"varlen{index}_b{batch}_h{nheads}-{nheads_kv}_d{head_dim}"
            + _flag_names(**{k: v for k, v in features.items() if k not in ("seqused_q", "seqused_k")},
                          seqused_q=features["seqused_q"] is not None, seqused_k=features["seqused_k"] is not None,
                          page=call["page_size"], deterministic=call["deterministic"]))
    return VarlenCase(name, tuple(seqlens_q), tuple(seqlens_k), nheads=nheads, nheads_kv=nheads_kv,
                      head_dim=head_dim, **features), call


def random_varlen_cases(count: int, max_len: int, first: int = 0) -> List[Tuple[VarlenCase, dict]]:
    return [random_varlen_case(i, max_len) for i in range(first, first + count)]


def random_kvcache_case(index: int, max_capacity: int, max_seqlen_q: int) -> Tuple[KvcacheCase, int]:
    """(case, num_splits) number `index`: caches of at most max_capacity rows per sequence,
    at most max_seqlen_q query rows."""
    rng = random.Random(f"kvcache-{index}")
    batch = rng.randint(1, 4)
    nheads_kv = rng.choice((1, 2, 3))
    nheads = nheads_kv * rng.choice((1, 2, 4, 8))
    head_dim = rng.choice((32, 64, 128, 40, 72, 96, 160, 192, 256))
    seqlen_q = 1 if rng.random() < 0.5 else rng.randint(2, max_seqlen_q)
    seqlens = rng.choices(("random", "zero", "none"), weights=(8, 1, 1))[0]
    seqlen_new = 0 if seqlens == "none" else rng.choice((0, seqlen_q, rng.randint(0, seqlen_q)))
    page_size = rng.choice((16, 32, 48, 64, 256)) if rng.random() < 0.3 else None
    if page_size is None:
        capacity = rng.randint(max(seqlen_new, 1), max_capacity)
    else:
        capacity = page_size * rng.randint(max(1, -(-seqlen_new // page_size)), max(1, max_capacity // page_size))
    rotary_dim = rng.choice((head_dim, head_dim // 2, 16)) if seqlen_new and rng.random() < 0.4 else 0
    features = dict(
        causal=rng.random() < 0.6, window=_window(rng, capacity),
        softcap=rng.choice((1.0, 5.0, 30.0)) if rng.random() < 0.2 else 0.0,
        rotary_dim=rotary_dim, rotary_interleaved=rng.random() < 0.5,
        leftpad=seqlens == "random" and rng.random() < 0.2,
        batch_idx=page_size is None and rng.random() < 0.2,
        sink=rng.random() < 0.2,
        alibi=rng.choice(("nheads", "batch_nheads")) if rng.random() < 0.2 else None,
        # An int cache_seqlens is capacity // 2 (kvcache_inputs.py): the new rows must fit after it.
        seqlens_as_int=seqlens == "random" and capacity // 2 + seqlen_new <= capacity and rng.random() < 0.1)
    num_splits = rng.choice((0, 0, 1, 2, 3, 7))
    name = (f"kvcache{index}_b{batch}_q{seqlen_q}_new{seqlen_new}_cap{capacity}_h{nheads}-{nheads_kv}_d{head_dim}"
            + _flag_names(**{k: v for k, v in features.items() if k != "rotary_interleaved"},
                          neox=rotary_dim > 0 and not features["rotary_interleaved"], page=page_size,
                          seqlens=seqlens if seqlens != "random" else None, splits=num_splits))
    return KvcacheCase(name, batch=batch, seqlen_q=seqlen_q, seqlen_new=seqlen_new, capacity=capacity,
                       nheads=nheads, nheads_kv=nheads_kv, head_dim=head_dim, page_size=page_size,
                       seqlens=seqlens, **features), num_splits


def random_kvcache_cases(count: int, max_capacity: int, max_seqlen_q: int,
                         first: int = 0) -> List[Tuple[KvcacheCase, int]]:
    return [random_kvcache_case(i, max_capacity, max_seqlen_q) for i in range(first, first + count)]
