"""flashattn_ext.integrations.transformers against transformers' own attention
implementations, on tiny randomly initialised models (CPU, fp32): padded and packed
batches, GQA, sliding window + softcap, training steps, dropout."""

import copy

import pytest
import torch

import flashattn_ext

transformers = pytest.importorskip("transformers")
fa_hf = pytest.importorskip("flashattn_ext.integrations.transformers")

NAME = fa_hf.register()
VOCAB, SEQ = 128, 12


def llama_config(**overrides):
    sizes = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaConfig(**{**sizes, **overrides})


def model_pair(config, reference="sdpa", cls=transformers.LlamaForCausalLM):
    """The same random weights under the reference implementation and ours. Each model
    gets its own config: _from_config writes the implementation name into the one given."""
    torch.manual_seed(0)
    ref = cls._from_config(copy.deepcopy(config), attn_implementation=reference)
    ours = cls._from_config(copy.deepcopy(config), attn_implementation=NAME)
    ours.load_state_dict(ref.state_dict())
    assert (ref.config._attn_implementation, ours.config._attn_implementation) == (reference, NAME)
    return ref.eval(), ours.eval()


def padded_batch(kind):
    """Token ids (3, SEQ) and a padding mask: row 0 padded by 4 on the `kind` side, row 1
    by 7, row 2 not at all."""
    ids = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, SEQ, dtype=torch.long)
    for row, pad in ((0, 4), (1, 7)):
        if kind == "left":
            mask[row, :pad] = 0
        else:
            mask[row, SEQ - pad:] = 0
    return ids, mask


def assert_same_logits_on_valid_tokens(ref, ours, kind):
    ids, mask = padded_batch(kind)
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask).logits
        got = ours(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], expected[valid], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["left", "right"])
def test_padded_batch_matches_sdpa_on_valid_tokens(kind):
    assert_same_logits_on_valid_tokens(*model_pair(llama_config()), kind)


def test_unpadded_gqa_causal_batch_matches_sdpa():
    ref, ours = model_pair(llama_config())
    ids, _ = padded_batch("left")
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, ref(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-5)


def test_packed_sequences_from_position_ids_match_sdpa():
    # Three sequences in one row, as padding-free collators pack them; sdpa applies the
    # packing only without a cache, hence use_cache=False on both.
    ref, ours = model_pair(llama_config())
    ids, _ = padded_batch("left")
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]])
    with torch.no_grad():
        expected = ref(input_ids=ids[:1], position_ids=position_ids, use_cache=False).logits
        got = ours(input_ids=ids[:1], position_ids=position_ids, use_cache=False).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_packed_row_trains_like_sdpa_on_the_padded_batch(monkeypatch):
    """Padding-free training: the sequences of a right-padded batch concatenated into one
    row, position_ids restarting per sequence, through flash_attn_varlen_func, give sdpa's
    loss and weight gradients on the padded batch. The label of each sequence's first token
    is -100: the model shifts labels by one, and in the padded batch nothing predicts it."""
    varlen_calls = []
    varlen = flashattn_ext.flash_attn_varlen_func
    monkeypatch.setattr(flashattn_ext, "flash_attn_varlen_func",
                        lambda *args, **kwargs: varlen_calls.append(1) or varlen(*args, **kwargs))
    ref, ours = model_pair(llama_config())
    ids, mask = padded_batch("right")
    valid = mask.bool()
    positions = torch.arange(SEQ).expand(3, -1)[valid]
    padded = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(~valid, -100))
    packed = dict(input_ids=ids[valid][None], position_ids=positions[None],
                  labels=ids[valid].masked_fill(positions == 0, -100)[None])
    losses = {}
    for model, inputs in ((ref, padded), (ours, packed)):
        losses[model.config._attn_implementation] = model(**inputs, use_cache=False).loss
        losses[model.config._attn_implementation].backward()
    assert len(varlen_calls) == ours.config.num_hidden_layers
    torch.testing.assert_close(losses[NAME], losses["sdpa"], atol=1e-6, rtol=1e-6)
    grads = {name: p.grad for name, p in ref.named_parameters()}
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_sliding_window_and_softcap_match_eager():
    # Gemma 2: alternating sliding-window (3 keys) and full layers, logit softcapping (small
    # enough to bend the scores of a random init),
    # which sdpa refuses; eager applies both through its dense mask.
    config = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        sliding_window=3, attn_logit_softcapping=0.05, query_pre_attn_scalar=16)
    assert_same_logits_on_valid_tokens(
        *model_pair(config, reference="eager", cls=transformers.Gemma2ForCausalLM), "left")


def gpt_oss_pair():
    # gpt-oss: a sink logit per head (s_aux), alternating sliding-window (3 keys) and full
    # layers, GQA, a mixture of experts; eager is transformers' reference for the sinks.
    config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=2, num_experts_per_tok=1, sliding_window=3,
        max_position_embeddings=64)
    ref, ours = model_pair(config, reference="eager", cls=transformers.GptOssForCausalLM)
    with torch.no_grad():  # sinks of a random init are zeros: give them weight
        for model in (ref, ours):
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, 4))
    return ref, ours


@pytest.mark.parametrize("kind", ["left", "right"])
def test_attention_sinks_match_eager(kind):
    assert_same_logits_on_valid_tokens(*gpt_oss_pair(), kind)


def test_attention_sink_gradients_match_eager():
    ids, mask = padded_batch("left")
    labels = ids.masked_fill(mask == 0, -100)
    grads = []
    for model in gpt_oss_pair():
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append([layer.self_attn.sinks.grad for layer in model.model.layers])
    for expected, got in zip(*grads):
        assert expected.abs().max() > 0
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_training_steps_match_sdpa():
    """AdamW steps on a padded batch from identical weights: the losses stay equal, so
    ours' backward (through the gathered and scattered rows too) matches sdpa's."""
    ids, mask = padded_batch("left")
    labels = ids.masked_fill(mask == 0, -100)
    losses = {}
    for model in model_pair(llama_config()):
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses[model.config._attn_implementation] = []
        for _ in range(5):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[model.config._attn_implementation].append(loss.item())
    assert losses["sdpa"][-1] < losses["sdpa"][0] - 0.1   # the steps did train
    torch.testing.assert_close(losses[NAME], losses["sdpa"], atol=1e-4, rtol=1e-5)


def test_attention_dropout_applies_in_training_only():
    _, ours = model_pair(llama_config(attention_dropout=0.1))
    ids, mask = padded_batch("right")

    def logits(seed):
        torch.manual_seed(seed)
        return ours(input_ids=ids, attention_mask=mask).logits

    with torch.no_grad():
        evaluated = logits(0)   # eval mode: transformers passes dropout 0
        ours.train()
        trained = logits(0)
    assert not torch.equal(trained, evaluated)
    assert torch.equal(trained, logits(0)), "torch.manual_seed reproduces the dropout masks"


def test_dense_4d_mask_is_refused():
    _, ours = model_pair(llama_config())
    ids, _ = padded_batch("left")
    dense = torch.ones(3, 1, SEQ, SEQ, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match=r"attention_mask must be a 2-D padding mask .* got shape \(3, 1, 12, 12\)"):
        ours(input_ids=ids, attention_mask=dense)


@pytest.mark.parametrize("name", ["flash_ext", "my sdpa", "", 3])
def test_register_refuses_names_transformers_dispatches_on(name):
    with pytest.raises(ValueError, match=r"register\(name\).* got " + repr(name).replace("(", r"\(")):
        fa_hf.register(name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["left", "right"])
def test_padded_batch_bf16_on_cuda_within_twice_sdpa_error(kind):
    # The CUDA kernels in bf16 against sdpa in bf16, both measured from the same
    # model's fp32 sdpa logits on the valid tokens (the flash-attn error rule).
    config = llama_config(hidden_size=256, intermediate_size=512)  # head dim 64
    ref, ours = model_pair(config)
    ids, mask = (t.cuda() for t in padded_batch(kind))
    valid = mask.bool()
    with torch.no_grad():
        exact = ref.cuda()(input_ids=ids, attention_mask=mask).logits[valid]
        expected = ref.to(torch.bfloat16)(input_ids=ids, attention_mask=mask).logits[valid].float()
        got = ours.cuda().to(torch.bfloat16)(input_ids=ids, attention_mask=mask).logits[valid].float()
    assert torch.isfinite(got).all()
    sdpa_error = (expected - exact).abs().max().item()
    ours_error = (got - exact).abs().max().item()
    assert ours_error <= 2 * sdpa_error + 1e-3, (ours_error, sdpa_error)
