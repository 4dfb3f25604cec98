"""DeBERTa's disentangled attention (He et al. 2020, eq. 2-4) against Hugging Face's
``DisentangledSelfAttention`` (random weights, the same weights copied by ``posenc.hf.deberta_from_hf``)
and against the formula written out pair by pair in float64.

The reference formula (eq. 4, the authors' index for p2c): with delta = i - j and
idx = clamp(bucket(delta) + k, 0, 2k - 1),
A_ij = (q_i . k_j + q_i . K_r[idx] + k_j . Q_r[idx]) / sqrt(D * (1 + n)).
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import posenc
from agreement import assert_decoding_equals_full, check_backends
from posenc.encodings.deberta import DeBERTa, log_bucket
from posenc.errors import UsageError

transformers = pytest.importorskip("transformers")
from transformers import DebertaV2Config  # noqa: E402
from transformers.models.deberta_v2 import modeling_deberta_v2 as hf  # noqa: E402

from posenc.hf import deberta_from_hf  # noqa: E402


@pytest.mark.parametrize("buckets, max_position", [(8, 32), (16, 64), (256, 512), (512, 4096), (64, 34), (4, 6)])
def test_log_buckets_equal_hugging_face(buckets, max_position):
    delta = torch.arange(-5000, 5001)
    want = hf.make_log_bucket_position(delta, buckets, max_position).long()
    torch.testing.assert_close(log_bucket(delta, buckets, max_position), want, rtol=0, atol=0)


def test_log_bucket_values_of_the_v3_setting():
    got = log_bucket(torch.tensor([0, 5, 128, 200, 300, 511, 1000, -200]), 256, 512).tolist()
    assert got == [0, 5, 128, 169, 207, 255, 317, -169]


def hf_encoder(share, pos_att_type, buckets, max_position, norm="layer_norm", dim=32, heads=4, seed=0):
    torch.manual_seed(seed)
    cfg = DebertaV2Config(hidden_size=dim, num_attention_heads=heads, num_hidden_layers=2, relative_attention=True,
                          position_buckets=buckets, max_relative_positions=max_position, share_att_key=share,
                          pos_att_type=pos_att_type, norm_rel_ebd=norm, position_biased_input=False,
                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    enc = hf.DebertaV2Encoder(cfg).eval()
    with torch.no_grad():  # larger than the init, so a wrong row or index shows
        for p in enc.parameters():
            p.normal_(0, 0.5)
    return enc


def hf_layer(enc, layer, x, mask):
    att = enc.layer[layer].attention.self
    return att(x, enc.get_attention_mask(mask), relative_pos=enc.get_rel_pos(x), rel_embeddings=enc.get_rel_embedding())[0]


SETTINGS = [(8, 32), (-1, 16), (16, 24), (256, 512)]  # (position_buckets, max_relative_positions); -1: v1-style


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("pos_att_type", ["c2p", "p2c", "p2c|c2p"])
@pytest.mark.parametrize("buckets, max_position", SETTINGS)
def test_one_layer_equals_hugging_face_disentangled_self_attention(share, pos_att_type, buckets, max_position, dtype):
    """A padded batch (right padding), 40 tokens: far past both the exact range and the table.
    float32: outputs of ~10 agree to 1e-5 relative (at most ~2e-5 absolute: the two sum the three
    terms in another order and Hugging Face rounds its scale to float32); float64 shows the function
    is the same to rounding."""
    enc = hf_encoder(share, pos_att_type, buckets, max_position).to(dtype)
    x = torch.randn(3, 40, 32, dtype=dtype)
    mask = torch.ones(3, 40, dtype=torch.long)
    mask[1, 25:] = 0
    mask[2, 7:] = 0
    with torch.no_grad():
        want = hf_layer(enc, 1, x, mask)
        attn = deberta_from_hf(enc, layer=1)
        got = attn(x, attention_mask=mask)
    real = mask.bool()
    # float64: Hugging Face computes sqrt(D (1 + n)) in float32 (`scaled_size_sqrt`): exact for one
    # term (sqrt(16) here), ~3e-8 relative off for both (sqrt(24)), so 1e-6 there, 1e-12 otherwise.
    tol = 1e-5 if dtype == torch.float32 else (1e-6 if "|" in pos_att_type else 1e-12)
    torch.testing.assert_close(got[real], want[real], rtol=tol, atol=tol)
    assert torch.all(got[~real] == 0)


def test_without_the_layer_norm_and_from_the_model():
    torch.manual_seed(1)
    cfg = DebertaV2Config(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, relative_attention=True,
                          position_buckets=8, max_relative_positions=20, pos_att_type="c2p|p2c", norm_rel_ebd="none",
                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, vocab_size=50)
    model = transformers.DebertaV2Model(cfg).eval()
    x = torch.randn(2, 30, 32)
    mask = torch.ones(2, 30, dtype=torch.long)
    with torch.no_grad():
        want = hf_layer(model.encoder, 0, x, mask)
        attn = deberta_from_hf(model, layer=0)
        assert attn.encoding.norm is None
        torch.testing.assert_close(attn(x), want, rtol=1e-5, atol=1e-5)


def test_the_paper_p2c_index_would_differ_from_the_code():
    """The check can see the p2c convention: reading Q_r at the mirrored index (the paper's
    delta(j, i)) moves the output far past the tolerance."""
    enc = hf_encoder(True, "p2c", 8, 32)
    x = torch.randn(1, 30, 32)
    mask = torch.ones(1, 30, dtype=torch.long)
    with torch.no_grad():
        want = hf_layer(enc, 0, x, mask)
        attn = deberta_from_hf(enc, layer=0)
        mirrored = attn.encoding.index
        attn.encoding.index = lambda qp, kp: mirrored(kp, qp).t()  # idx of delta(j, i)
        assert (attn(x) - want).abs().max() > 1e-2


def test_the_importer_refuses_what_it_cannot_express():
    with pytest.raises(UsageError, match="DebertaV2Encoder"):
        deberta_from_hf(torch.nn.Linear(2, 2))
    enc = hf_encoder(True, "c2p", 8, 32)
    with pytest.raises(UsageError, match=r"layer must be an integer in \[0, 1\]"):
        deberta_from_hf(enc, layer=2)


# --------------------------------------------------------------------------------------------
# The formula, pair by pair, in float64.


def pairwise(enc: DeBERTa, q, k, v, qp, kp, causal):
    """softmax((q.k + c2p + p2c) / sqrt(D (1 + n))) v, every pair written out."""
    kr, qr = enc.position_tables()
    n = (kr is not None) + (qr is not None)
    b, h, tq, d = q.shape
    span = enc.span
    scores = torch.empty(b, h, tq, kp.numel(), dtype=torch.float64)
    for a, i in enumerate(qp.tolist()):
        for c, j in enumerate(kp.tolist()):
            delta = i - j
            if enc.position_buckets:
                mid = enc.position_buckets // 2
                if abs(delta) <= mid:
                    bucket = delta
                else:
                    far = mid + math.ceil(math.log(abs(delta) / mid) / math.log((enc.max_relative_positions - 1) / mid) * (mid - 1))
                    bucket = far if delta > 0 else -far
            else:
                bucket = delta
            row = min(max(bucket + span, 0), 2 * span - 1)
            s = (q[:, :, a] * k[:, :, c]).sum(-1)
            if kr is not None:
                s = s + (q[:, :, a] * kr[:, row]).sum(-1)
            if qr is not None:
                s = s + (k[:, :, c] * qr[:, row]).sum(-1)
            scores[:, :, a, c] = s / math.sqrt(d * (1 + n))
    if causal:
        scores = scores.masked_fill(kp[None, :] > qp[:, None], float("-inf"))
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("buckets, max_position, pos_att_type", [(8, 20, "c2p|p2c"), (0, 6, "p2c"), (6, 12, "c2p")])
@pytest.mark.parametrize("qp, kp", [(torch.arange(24), torch.arange(24)), (torch.arange(20, 24), torch.arange(24)),
                                     (torch.tensor([0, 3, 9, 30]), torch.tensor([0, 3, 9, 30]))])
def test_attend_equals_the_formula_in_float64(causal, buckets, max_position, pos_att_type, qp, kp):
    torch.manual_seed(2)
    enc = posenc.build("deberta", num_heads=2, head_dim=8, causal=causal, position_buckets=buckets,
                       max_relative_positions=max_position, pos_att_type=pos_att_type).double()
    with torch.no_grad():
        enc.rel_embeddings.normal_()
    q = torch.randn(2, 2, qp.numel(), 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, kp.numel(), 8, dtype=torch.float64), torch.randn(2, 2, kp.numel(), 8, dtype=torch.float64)
    got = posenc.attend(q, k, v, enc, positions=qp, k_positions=kp, causal=causal)
    with torch.no_grad():
        want = pairwise(enc, q, k, v, qp, kp, causal)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
def test_every_backend_agrees_with_eager(causal):
    enc = posenc.build("deberta", num_heads=4, head_dim=16, causal=causal, position_buckets=16, max_relative_positions=64)
    assert "terms" in check_backends(enc, causal)


def test_cached_decoding_equals_the_full_pass():
    config = posenc.LMConfig(vocab_size=32, dim=32, depth=2, num_heads=4, encoding="deberta",
                             encoding_options={"position_buckets": 8, "max_relative_positions": 12})
    torch.manual_seed(3)
    assert_decoding_equals_full(posenc.LM(config).eval())


def test_the_content_scale_counts_the_position_terms():
    assert posenc.build("deberta", num_heads=2, head_dim=8).content_scale == 1 / math.sqrt(8 * 3)
    assert posenc.build("deberta", num_heads=2, head_dim=8, pos_att_type="p2c").content_scale == 1 / math.sqrt(16)
    assert posenc.build("nope", num_heads=2, head_dim=8).content_scale is None


@pytest.mark.parametrize("options, message", [
    ({"position_buckets": -1}, "position_buckets must be an integer >= 0"),
    ({"position_buckets": 1}, "position_buckets must be >= 2"),
    ({"position_buckets": 16, "max_relative_positions": 9}, "max_relative_positions must be > position_buckets // 2 + 1 = 9"),
    ({"max_relative_positions": 0}, "max_relative_positions must be a positive integer"),
    ({"pos_att_type": "c2p|x"}, "pos_att_type must be 'c2p', 'p2c' or 'c2p|p2c', got 'c2p|x'"),
    ({"pos_att_type": ""}, "pos_att_type must be"),
    ({"layer_norm": 1}, "layer_norm must be True or False"),
    ({"layer_norm_eps": 0}, "layer_norm_eps must be a number > 0"),
])
def test_bad_options_name_the_parameter(options, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        posenc.build("deberta", num_heads=2, head_dim=8, **options)
