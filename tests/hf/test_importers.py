"""posenc.hf.importers against Hugging Face's own modules (random-init configs, nothing downloaded).

References: ``transformers``' ``T5Attention.compute_bias`` (encoder and decoder, with a decode
offset) and BLOOM's ``build_alibi_tensor``.
"""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc.hf import alibi_from_bloom, t5_attention, t5_from_hf, t5_to_hf

transformers = pytest.importorskip("transformers")
from transformers import T5Config, T5EncoderModel, T5Model  # noqa: E402
from transformers.models.bloom.modeling_bloom import build_alibi_tensor  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_t5(num_buckets: int = 32, max_distance: int = 128, heads: int = 4) -> T5Model:
    config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=heads,
                      relative_attention_num_buckets=num_buckets, relative_attention_max_distance=max_distance)
    model = T5Model(config).eval()
    with torch.no_grad():  # distinct values in every cell, so a wrong bucket or head shows
        for stack in (model.encoder, model.decoder):
            stack.block[0].layer[0].SelfAttention.relative_attention_bias.weight.normal_()
    return model


@pytest.mark.parametrize("stack", ["encoder", "decoder"])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (16, 20), (33, 100)])
def test_t5_import_equals_compute_bias(stack: str, num_buckets: int, max_distance: int) -> None:
    model = tiny_t5(num_buckets, max_distance)
    owner = t5_attention(model, stack=stack)
    assert owner is getattr(model, stack).block[0].layer[0].SelfAttention  # the layer that owns the table
    encoding = t5_from_hf(model, stack=stack)
    assert encoding.causal == (stack == "decoder") and encoding.num_heads == 4
    for tq, tk, past in ((300, 300, 0), (1, 301, 300), (7, 57, 50)):
        theirs = owner.compute_bias(tq, tk, past_seen_tokens=past)[0]  # (H, Tq, Tk)
        ours = encoding.bias(torch.arange(past, past + tq), torch.arange(tk))
        assert torch.equal(ours, theirs), (stack, tq, tk, past)


@pytest.mark.parametrize("stack", ["encoder", "decoder"])
def test_t5_export_equals_compute_bias(stack: str) -> None:
    model = tiny_t5(16, 64)
    encoding = posenc.build("t5", num_heads=4, head_dim=8, causal=stack == "decoder", num_buckets=16, max_distance=64)
    with torch.no_grad():
        encoding.relative_attention_bias.weight.normal_()
    owner = t5_to_hf(encoding, model, stack=stack)
    theirs = owner.compute_bias(200, 200)[0]
    ours = encoding.bias(torch.arange(200), torch.arange(200))
    assert torch.equal(ours, theirs)
    assert torch.equal(t5_from_hf(model, stack=stack).relative_attention_bias.weight, encoding.relative_attention_bias.weight)


def test_t5_encoder_only_model_and_owner_module() -> None:
    config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=2)
    model = T5EncoderModel(config)
    owner = model.encoder.block[0].layer[0].SelfAttention
    assert t5_attention(model) is owner and t5_attention(owner) is owner
    assert not t5_from_hf(owner).causal


def test_t5_import_errors_name_the_parameter() -> None:
    model = tiny_t5()
    with pytest.raises(posenc.UsageError, match="stack='encoder' or stack='decoder'"):
        t5_from_hf(model)
    with pytest.raises(posenc.UsageError, match="stack must be one of"):
        t5_from_hf(model, stack="middle")
    with pytest.raises(posenc.UsageError, match="layer"):
        t5_from_hf(model, stack="encoder", layer=5)
    with pytest.raises(posenc.UsageError, match="holds no T5"):
        t5_from_hf(model, stack="encoder", layer=1)  # block 1 reuses block 0's table
    wrong = posenc.build("t5", num_heads=4, head_dim=8, causal=True)
    with pytest.raises(posenc.UsageError, match="causal"):
        t5_to_hf(wrong, model, stack="encoder")
    with pytest.raises(posenc.UsageError, match="num_buckets"):
        t5_to_hf(posenc.build("t5", num_heads=4, head_dim=8, num_buckets=16), model, stack="decoder")
    with pytest.raises(posenc.UsageError, match="t5 encoding"):
        t5_to_hf(posenc.build("alibi", num_heads=4, head_dim=8), model, stack="decoder")


def test_bloom_alibi_equals_posenc_for_1_to_64_heads() -> None:
    """BLOOM adds m_h * j (j counts the row's real keys); ALiBi's -m_h (i - j) differs from it by
    -m_h * i, a constant per query row, which softmax ignores: compare after removing it, and the
    softmax itself."""
    t = 40
    mask = torch.ones(1, t, dtype=torch.long)
    i = torch.arange(t)
    for heads in range(1, 65):
        encoding = alibi_from_bloom({"n_head": heads, "hidden_size": 8 * heads})
        assert encoding.num_heads == heads and encoding.head_dim == 8
        term = build_alibi_tensor(mask, heads, torch.float32).view(heads, 1, t)  # (H, 1, Tk): m_h * j
        ours = encoding.bias(i, i)  # (H, Tq, Tk)
        slopes = encoding.slopes[:, None, None]
        torch.testing.assert_close(ours + slopes * i[None, :, None], term.expand(heads, t, t), rtol=1e-6, atol=1e-5)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        p_ours = ours.masked_fill(~causal, float("-inf")).softmax(-1)
        p_theirs = term.expand(heads, t, t).masked_fill(~causal, float("-inf")).softmax(-1)
        torch.testing.assert_close(p_ours, p_theirs, rtol=0, atol=1e-6)


def test_bloom_alibi_left_padding_counts_real_keys_only() -> None:
    """With left padding BLOOM counts j from the row's first real token: posenc's bias at the row's
    own positions (0 at its first real token) is the same up to the per-query constant."""
    heads, pad, t = 6, 3, 12
    mask = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones(1, t - pad, dtype=torch.long)], dim=1)
    term = build_alibi_tensor(mask, heads, torch.float32).view(heads, 1, t)[..., pad:]  # real keys
    encoding = alibi_from_bloom({"n_head": heads, "hidden_size": 48})
    positions = torch.arange(t - pad)
    ours = encoding.bias(positions, positions)
    torch.testing.assert_close(ours + encoding.slopes[:, None, None] * positions[None, :, None], term.expand_as(ours))


def test_bloom_config_errors() -> None:
    with pytest.raises(posenc.UsageError, match="n_head"):
        alibi_from_bloom({"n_head": 0, "hidden_size": 8})
    with pytest.raises(posenc.UsageError, match="hidden_size"):
        alibi_from_bloom({"n_head": 3, "hidden_size": 8})
    config = transformers.BloomConfig(n_head=4, hidden_size=32, n_layer=1)
    assert alibi_from_bloom(config).num_heads == 4
