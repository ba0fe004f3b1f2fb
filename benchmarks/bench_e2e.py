"""End-to-end training steps with our attention plugged into Hugging Face transformers.

* GPT-2 small shape (12 layers, 12 heads, hidden 768, vocab 50257), causal LM, at
  sequence 1k, 2k, 4k with the same tokens per step;
* BERT-large shape (24 layers, 16 heads, hidden 1024), masked-LM head, sequence 512,
  non-causal;
* gpt2_packed: the GPT-2 model trained padding-free. A batch of sequences of mixed
  lengths (uniform in [seqlen/4, seqlen], from the seed) is packed into one row, with
  position_ids restarting at 0 per sequence and the label of each sequence's first token
  set to -100 (the model shifts labels by one, so the last token of a sequence would
  otherwise be trained to predict the next sequence's first). The integration sends such
  a row through flash_attn_varlen_func, each sequence attended on its own, and the script
  checks that every attention call of ours went through it. The other implementations,
  and ours once more, train the same sequences as a right-padded batch with an
  attention_mask and labels -100 on the padding: the same tokens are predicted, so the
  first loss of ours packed must equal sdpa's padded. tokens/s counts real tokens only.
  (GPT-2's attention receives position_ids, so no Llama-shaped stand-in is needed.)

All are built from a config with random weights (nothing is downloaded), fp32 master
weights with bf16 autocast, fused AdamW, dropout off (so all implementations do the same
work). Ours is the package's transformers integration (flashattn_ext.integrations.
transformers.register(), which also handles padding) selected with attn_implementation=...; the same model
runs with "eager" (materialised scores) and "sdpa" (torch's dispatcher: FlashAttention-2
or cuDNN on this GPU). Reported: tokens/s of optimizer steps, peak memory, and the loss
of the first step, which must agree across implementations (same seed, same weights).

If transformers (or its AttentionInterface) is missing, a small self-written GPT / encoder
of the same shapes is used instead, and the output says so.

    python benchmarks/bench_e2e.py --quick --out results/e2e
    python benchmarks/bench_e2e.py --models gpt2_packed --out results/e2e_packed
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import bench_common as bc

IMPLS = {"ours": None, "sdpa": "sdpa", "eager": "eager"}   # ours: the name register() returns
# Per point kind: the architecture trained, the batch layout ours trains and the layout
# every implementation trains ("full": rows of seqlen tokens without padding).
KINDS = {"gpt2": dict(arch="gpt2", ours_layout="full", layout="full"),
         "bert": dict(arch="bert", ours_layout="full", layout="full"),
         "gpt2_packed": dict(arch="gpt2", ours_layout="packed", layout="padded")}
# Calls of the attention function and of flash_attn_varlen_func: prove ours is what ran,
# and that padded and packed batches took the varlen path.
ATTENTION_CALLS = {"attention": 0, "varlen": 0}


def counted(fn, key):
    """fn, counting its calls in ATTENTION_CALLS[key]."""
    def wrapper(*args, **kwargs):
        ATTENTION_CALLS[key] += 1
        return fn(*args, **kwargs)
    return wrapper


def register_ours():
    """Ours through the package's transformers integration, its attention function and
    flash_attn_varlen_func wrapped in the call counters; fills in IMPLS["ours"]."""
    from transformers import AttentionInterface
    import flashattn_ext
    import flashattn_ext.integrations.transformers as fa_hf

    name = fa_hf.register()
    AttentionInterface.register(name, counted(fa_hf.attention_forward, "attention"))
    # The integration looks the function up on the package at each call.
    flashattn_ext.flash_attn_varlen_func = counted(flashattn_ext.flash_attn_varlen_func, "varlen")
    IMPLS["ours"] = name
    return fa_hf.attention_forward


def check_integration(ours_fn, device) -> list[dict]:
    """The integration's attention function against transformers' own sdpa attention
    function, called the way the models call it (module, q, k, v in (batch, heads, seq,
    dim), mask None, scaling), causal
    and not: a layout or causality mistake in the wiring shows here at O(1), where a
    training loss from random weights would hide it."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa_fn = ALL_ATTENTION_FUNCTIONS["sdpa"]
    gen = bc.make_generator(device, 1234)
    results = []
    for causal in (False, True):
        module = nn.Module()
        module.is_causal = causal
        q, k, v = (bc.random_tensor((2, 4, 128, 64), torch.bfloat16, device, gen) for _ in range(3))
        ours = ours_fn(module, q, k, v, None, scaling=0.125)[0]
        ref = sdpa_fn(module, q, k, v, None, scaling=0.125)[0]
        diff = (ours.float() - ref.float()).abs().max().item()
        results.append(dict(check="integration vs transformers sdpa", causal=causal,
                            max_abs_diff=diff, passed=diff < 2e-2))
        print(f"check integration causal={causal}: max|ours - transformers sdpa| = {diff:.2e} "
              f"{'ok' if diff < 2e-2 else 'FAILED'}")
    return results


def transformers_available():
    try:
        from transformers import AttentionInterface, GPT2LMHeadModel, BertForMaskedLM  # noqa: F401
        return True
    except Exception as exc:
        print(f"transformers not usable ({exc}); using the self-written fallback models")
        return False


# --------------------------------------------------------------------------- fallback models

class FallbackBlock(nn.Module):
    """Pre-LN transformer block whose attention is one of the three implementations."""

    def __init__(self, hidden, heads, causal, impl):
        super().__init__()
        self.heads, self.causal, self.impl = heads, causal, impl
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scale = (h // self.heads) ** -0.5
        if self.impl == "ours":
            import flashattn_ext
            ATTENTION_CALLS["attention"] += 1
            attn = flashattn_ext.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)),
                                                 softmax_scale=scale, causal=self.causal)
        elif self.impl == "sdpa":
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, scale=scale).transpose(1, 2)
        else:
            attn = bc.materialized_attention(q, k, v, self.causal, scale).transpose(1, 2)
        x = x + self.proj(attn.reshape(b, s, h))
        return x + self.mlp(self.ln2(x))


class FallbackLM(nn.Module):
    def __init__(self, vocab, positions, hidden, layers, heads, causal, impl):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(positions, hidden)
        self.blocks = nn.ModuleList(FallbackBlock(hidden, heads, causal, impl) for _ in range(layers))
        self.ln = nn.LayerNorm(hidden)
        self.causal = causal
        for emb in (self.tok, self.pos):   # GPT-2's init; N(0, 1) would give huge tied logits
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, input_ids, labels):
        x = self.tok(input_ids) + self.pos(torch.arange(input_ids.shape[1], device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.ln(x) @ self.tok.weight.t()
        if self.causal:  # next-token prediction, as GPT2LMHeadModel shifts its labels
            logits, labels = logits[:, :-1], labels[:, 1:]
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


# --------------------------------------------------------------------------- models

def model_shapes(args, device):
    cpu = device.type == "cpu"
    gpt = dict(vocab=1000, hidden=64, layers=2, heads=2) if cpu else \
        dict(vocab=50257, hidden=768, layers=12, heads=12)
    bert = dict(vocab=1000, hidden=64, layers=2, heads=2) if cpu else \
        dict(vocab=30522, hidden=1024, layers=24, heads=16)
    if args.layers:
        gpt["layers"] = bert["layers"] = args.layers
    return gpt, bert


def build_model(arch, impl, shape, positions, use_hf, device):
    if not use_hf:
        return FallbackLM(shape["vocab"], positions, shape["hidden"], shape["layers"], shape["heads"],
                          causal=(arch == "gpt2"), impl=impl).to(device)
    if arch == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        cfg = GPT2Config(vocab_size=shape["vocab"], n_positions=positions, n_embd=shape["hidden"],
                         n_layer=shape["layers"], n_head=shape["heads"], attn_pdrop=0.0,
                         embd_pdrop=0.0, resid_pdrop=0.0, use_cache=False, bos_token_id=0,
                         eos_token_id=0)
        cls = GPT2LMHeadModel
    else:
        from transformers import BertConfig, BertForMaskedLM
        cfg = BertConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                         num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                         intermediate_size=4 * shape["hidden"], max_position_embeddings=positions,
                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        cls = BertForMaskedLM
    with torch.device(device):
        model = cls._from_config(cfg, attn_implementation=IMPLS[impl])
    if model.config._attn_implementation != IMPLS[impl]:
        raise SystemExit(f"transformers picked {model.config._attn_implementation!r} instead of "
                         f"{IMPLS[impl]!r}: the comparison would be meaningless")
    return model.to(device)


def make_inputs(layout, shape, batch, seqlen, seed, device):
    """The model's keyword arguments for one step and the number of real (not padding)
    tokens in them. "full": batch rows of seqlen random tokens. "padded" and "packed": the
    same batch sequences of lengths uniform in [seqlen/4, seqlen], right-padded to seqlen,
    or concatenated into one row with restarting position_ids."""
    gen = bc.make_generator(device, seed + 1)
    ids = torch.randint(0, shape["vocab"], (batch, seqlen), device=device, generator=gen)
    if layout == "full":
        return dict(input_ids=ids, labels=ids), ids.numel()
    lengths = torch.randint(max(seqlen // 4, 2), seqlen + 1, (batch,),
                            generator=torch.Generator().manual_seed(seed + 2)).to(device)
    positions = torch.arange(seqlen, device=device).expand(batch, -1)
    valid = positions < lengths[:, None]
    if layout == "padded":
        inputs = dict(input_ids=ids, attention_mask=valid.long(), labels=ids.masked_fill(~valid, -100))
    else:
        # Row-major selection keeps each sequence's tokens together and in order. The model
        # shifts labels by one: without the -100 the last token of a sequence would be
        # trained to predict the next one's first, which nothing predicts in a padded row.
        packed_positions = positions[valid]
        inputs = dict(input_ids=ids[valid][None], position_ids=packed_positions[None],
                      labels=ids[valid].masked_fill(packed_positions == 0, -100)[None])
    return inputs, int(lengths.sum())


def run_label(row):
    """The implementation, with the batch layout where it is not the plain one (result
    files from before the packed mode have no layout)."""
    return row["impl"] if row.get("layout", "full") == "full" else f"{row['impl']} {row['layout']}"


def loss_of(model, inputs, use_hf):
    if use_hf:
        return model(**inputs).loss
    return model(inputs["input_ids"], inputs["labels"])


def train_point(kind, impl, layout, shape, batch, seqlen, args, device, use_hf):
    """Warm-up steps, then timed optimizer steps: tokens/s (real tokens), peak memory,
    first loss."""
    torch.manual_seed(args.seed)   # same weights for every implementation
    model = build_model(KINDS[kind]["arch"], impl, shape, seqlen, use_hf, device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=bc.is_cuda(device))
    inputs, tokens = make_inputs(layout, shape, batch, seqlen, args.seed, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def step():
        with autocast:
            loss = loss_of(model, inputs, use_hf)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    ATTENTION_CALLS.update(attention=0, varlen=0)
    first_loss = step().item()
    if impl == "ours" and ATTENTION_CALLS["attention"] == 0:
        raise SystemExit("the registered attention function was never called: ours did not run")
    if impl == "ours" and layout != "full" and ATTENTION_CALLS["varlen"] != ATTENTION_CALLS["attention"]:
        raise SystemExit(f"{layout} batch: {ATTENTION_CALLS['varlen']} of {ATTENTION_CALLS['attention']} "
                         "attention calls went through flash_attn_varlen_func")
    for _ in range(max(args.warmup_steps - 1, 0)):
        step()
    bc.synchronize(device)
    if bc.is_cuda(device):
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    bc.synchronize(device)
    elapsed = time.perf_counter() - t0
    result = dict(first_loss=first_loss, step_ms=elapsed / args.steps * 1e3, tokens=tokens,
                  tokens_per_s=tokens * args.steps / elapsed,
                  params=sum(p.numel() for p in model.parameters()))
    if bc.is_cuda(device):
        peak = torch.cuda.max_memory_allocated(device)
        result.update(peak_bytes=peak, peak_step_bytes=peak - base)
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_common_args(p, default_out="benchmarks/results/e2e")
    p.add_argument("--models", nargs="+", choices=list(KINDS), default=list(KINDS))
    p.add_argument("--impls", nargs="+", choices=list(IMPLS), default=list(IMPLS))
    p.add_argument("--gpt2-seqlens", type=int, nargs="+", default=None)
    p.add_argument("--gpt2-tokens", type=int, default=None, help="tokens per step (8192)")
    p.add_argument("--packed-seqlen", type=int, default=None,
                   help="gpt2_packed: the longest sequence (2048); the batch has --gpt2-tokens / this many")
    p.add_argument("--bert-seqlen", type=int, default=None)
    p.add_argument("--bert-batch", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="timed steps per point")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--layers", type=int, default=None, help="override the layer count")
    p.add_argument("--no-transformers", action="store_true", help="force the fallback models")
    p.add_argument("--loss-tolerance", type=float, default=0.05,
                   help="max |first loss of ours - of sdpa| before ours is marked WRONG")
    return p.parse_args(argv)


def apply_defaults(args, device):
    cpu = device.type == "cpu"
    args.gpt2_seqlens = args.gpt2_seqlens or ([64, 128] if cpu else [1024, 2048, 4096])
    args.gpt2_tokens = args.gpt2_tokens or (256 if cpu else 8192)
    args.packed_seqlen = args.packed_seqlen or (64 if cpu else 2048)
    args.bert_seqlen = args.bert_seqlen or (64 if cpu else 512)
    args.bert_batch = args.bert_batch or (2 if cpu else 16)
    args.steps = args.steps or (2 if cpu else (4 if args.quick else 10))
    if "ours" not in args.impls:
        args.impls = ["ours"] + list(args.impls)
    return args


def main(argv=None):
    args = parse_args(argv)
    device = bc.resolve_device(args.device)
    args = apply_defaults(args, device)
    bc.import_ours(device)
    out_dir = bc.ensure_out_dir(args.out)
    deadline = bc.Deadline(args.time_limit_s)
    use_hf = not args.no_transformers and transformers_available()
    checks = []
    if use_hf:
        checks += check_integration(register_ours(), device)
    model_source = (f"transformers {__import__('transformers').__version__}" if use_hf
                    else "self-written fallback models (transformers not used)")
    gpt_shape, bert_shape = model_shapes(args, device)
    points = []
    if "gpt2" in args.models:
        points += [("gpt2", gpt_shape, max(args.gpt2_tokens // n, 1), n) for n in args.gpt2_seqlens]
    if "bert" in args.models:
        points.append(("bert", bert_shape, args.bert_batch, args.bert_seqlen))
    if "gpt2_packed" in args.models:
        points.append(("gpt2_packed", gpt_shape, max(args.gpt2_tokens // args.packed_seqlen, 1),
                       args.packed_seqlen))
    rows = []
    # Ours in its own layout first, then every implementation in the point's layout.
    work = [(p, run) for p in points
            for run in dict.fromkeys([("ours", KINDS[p[0]]["ours_layout"])]
                                     + [(impl, KINDS[p[0]]["layout"]) for impl in args.impls])]
    for (kind, shape, batch, seqlen), (impl, layout) in bc.progress(work, desc="e2e points"):
        row = dict(model=kind, model_source=model_source, impl=impl, attn_implementation=IMPLS[impl],
                   layout=layout, batch=batch, seqlen=seqlen, layers=shape["layers"],
                   hidden=shape["hidden"], heads=shape["heads"], status=bc.STATUS_OK, reason="")
        if deadline.expired():
            row.update(status=bc.STATUS_SKIPPED, reason="time limit")
        elif layout != "full" and not use_hf:
            row.update(status=bc.STATUS_SKIPPED, reason="padded and packed batches need transformers")
        else:
            try:
                row.update(train_point(kind, impl, layout, shape, batch, seqlen, args, device, use_hf))
            except bc.RUN_FAILURES as exc:
                row.update(zip(("status", "reason"), bc.classify_failure(exc)))
        bc.free_memory(device)
        rows.append(row)
        bc.write_csv(rows, out_dir / "e2e.csv")

    # Same seed, same weights, same predicted tokens: the first losses must agree, for
    # every run of ours (packed and padded in gpt2_packed) against the reference's.
    summary = {}
    for kind, _, batch, seqlen in points:
        group = {(r["impl"], r["layout"]): r for r in rows if (r["model"], r["seqlen"]) == (kind, seqlen)}
        layout = KINDS[kind]["layout"]
        ours = group.get(("ours", KINDS[kind]["ours_layout"]))
        ref = group.get(("sdpa", layout)) or group.get(("eager", layout))
        for r in (r for r in group.values() if r["impl"] == "ours"):
            if ref and r["status"] == bc.STATUS_OK and ref["status"] == bc.STATUS_OK:
                diff = abs(r["first_loss"] - ref["first_loss"])
                passed = diff <= args.loss_tolerance
                checks.append(dict(model=kind, seqlen=seqlen, ours=run_label(r), ref=run_label(ref),
                                   first_loss_ours=r["first_loss"], first_loss_ref=ref["first_loss"],
                                   diff=diff, passed=passed))
                if not passed:
                    r.update(status=bc.STATUS_WRONG,
                             reason=f"first loss differs by {diff:.3g} from {run_label(ref)}")
        for r in group.values():
            if ours and ours["status"] == bc.STATUS_OK and r["status"] == bc.STATUS_OK:
                r["ours_speedup"] = ours["tokens_per_s"] / r["tokens_per_s"]
                if r is not ours:
                    summary[f"{kind}_seq{seqlen}_vs_{run_label(r).replace(' ', '_')}"] = r["ours_speedup"]
    table = [{"model": r["model"], "seq": r["seqlen"], "batch": r["batch"], "tokens": r.get("tokens"),
              "impl": run_label(r),
              "tokens/s": r.get("tokens_per_s") if r["status"] == bc.STATUS_OK else r["status"],
              "ours speedup": f"{r['ours_speedup']:.2f}x" if r.get("ours_speedup") else "",
              "peak": bc.human_bytes(r.get("peak_bytes")), "first loss": r.get("first_loss")}
             for r in rows]
    print(bc.format_table(table, title=f"\nEnd-to-end training steps ({model_source}), bf16 autocast, "
                          "AdamW, dropout off; tokens/s of real tokens (no padding); "
                          "ours speedup = ours tokens/s / impl tokens/s"))
    for c in checks:
        if "model" not in c:
            continue   # the integration checks were printed when they ran
        print(f"check {c['model']} seq {c['seqlen']}: first loss {c['ours']} {c['first_loss_ours']:.4f} vs "
              f"{c['ref']} {c['first_loss_ref']:.4f} {'ok' if c['passed'] else 'FAILED'}")
    bc.write_csv(rows, out_dir / "e2e.csv")
    bc.write_json(bc.result_document("e2e", args, device, rows, checks=checks, model_source=model_source,
                                     summary=summary, complete=True), out_dir / "e2e.json")
    print(f"wrote {out_dir}/e2e.csv, .json")
    return bc.ours_exit_code(rows, checks)


if __name__ == "__main__":
    sys.exit(main())
