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
import posenc.hf
from agreement import assert_decoding_equals_full, check_backends
from posenc.encodings.deberta import DeBERTa, log_bucket
from posenc.errors import UsageError

transformers = pytest.importorskip("transformers")
from transformers import DebertaV2Config  # noqa: E402
from transformers.models.deberta_v2 import modeling_deberta_v2 as hf  # noqa: E402

from posenc.hf import deberta_from_hf  # noqa: E402


def raises(message: str):
    return pytest.raises(UsageError, match=f"^{re.escape(message)}$")



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
def test_one_layer_equals_hugging_face_disentangled_self_attention(share, pos_att_type, buckets, max_position, dtype,
                                                                   monkeypatch):
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
        chosen = attn(x, attention_mask=mask)  # auto: these short calls are cheaper eager
        taken = forced(monkeypatch)
        got = attn(x, attention_mask=mask)
    assert attn.last_backend == "terms" and "attention" in taken  # the fast path (tests below check it is the one taken)
    real = mask.bool()
    # float64: Hugging Face computes sqrt(D (1 + n)) in float32 (`scaled_size_sqrt`): exact for one
    # term (sqrt(16) here), ~3e-8 relative off for both (sqrt(24)), so 1e-6 there, 1e-12 otherwise.
    tol = 1e-5 if dtype == torch.float32 else (1e-6 if "|" in pos_att_type else 1e-12)
    for out in (got, chosen):
        torch.testing.assert_close(out[real], want[real], rtol=tol, atol=tol)
        assert torch.all(out[~real] == 0)


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


def test_the_paper_p2c_index_would_differ_from_the_code(monkeypatch):
    """The check can see the p2c convention: reading Q_r at the mirrored index (the paper's
    delta(j, i)) moves the output far past the tolerance."""
    forced(monkeypatch)
    enc = hf_encoder(True, "p2c", 8, 32)
    x = torch.randn(1, 30, 32)
    mask = torch.ones(1, 30, dtype=torch.long)
    with torch.no_grad():
        want = hf_layer(enc, 0, x, mask)
        attn = deberta_from_hf(enc, layer=0)
        mirrored = attn.encoding.relative_rows  # index() and the fast backend both read it
        attn.encoding.relative_rows = lambda r: mirrored(-r)  # idx of delta(j, i)
        assert (attn(x) - want).abs().max() > 1e-2
        assert attn.last_backend == "terms"


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


# --------------------------------------------------------------------------------------------
# The fast path (terms' DisentangledTables path: backends/parts/disentangled.py, its decode step in parts/single.py).

FAST = [  # (position_buckets, max_relative_positions, pos_att_type): log buckets, v1, b < 4, odd b
    (8, 20, "c2p|p2c"), (16, 24, "p2c"), (6, 12, "c2p"), (0, 6, "c2p|p2c"), (2, 5, "c2p|p2c"), (5, 14, "p2c|c2p"),
]


def forced(monkeypatch):
    """The fast full pass for every call it can run, however short (the cost model of
    ``disentangled.worthwhile`` sends short calls to eager); returns :func:`spied`'s record."""
    from posenc.backends.parts import disentangled

    monkeypatch.setattr(disentangled, "worthwhile", lambda *a: True)
    return spied(monkeypatch)


def spied(monkeypatch):
    """Record the calls of the fast full pass and the fast decode step."""
    from posenc.backends.parts import disentangled, single

    taken = []
    for module, name, label in ((disentangled, "attention", "attention"), (single, "disentangled", "step")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=label: taken.append(_n) or _f(*a))
    return taken


def built(causal, buckets, max_position, pos_att_type, heads=2, dim=8, seed=4):
    torch.manual_seed(seed)
    enc = posenc.build("deberta", num_heads=heads, head_dim=dim, causal=causal, position_buckets=buckets,
                       max_relative_positions=max_position, pos_att_type=pos_att_type)
    with torch.no_grad():  # larger than the init, so a wrong row or index shows
        for p in enc.parameters():
            p.normal_(0, 0.5)
    return enc


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("buckets, max_position, pos_att_type", FAST)
@pytest.mark.parametrize("tq, tk", [(70, 70), (23, 70), (3, 3)])
def test_the_fast_path_equals_the_formula_outputs_and_gradients_in_float64(causal, buckets, max_position, pos_att_type, tq, tk,
                                                                         monkeypatch):
    """70 keys: far past every bucket range above (both sides, for encoders), so the band, the far
    past and the far future all take part; (23, 70): queries after a KV cache; outputs and the
    gradients of q, k, v and every encoding parameter against eager and the pair-by-pair formula."""
    from posenc.backends import eager, terms
    from posenc.backends.parts.base import ScoreSpec

    enc = built(causal, buckets, max_position, pos_att_type).double()
    kp = torch.arange(3, 3 + tk)
    qp = kp[tk - tq:]
    spec = ScoreSpec(encoding=enc, q_positions=qp, k_positions=kp, causal=causal, scale=enc.content_scale)
    q, k, v = (torch.randn(2, 2, n, 8, dtype=torch.float64, requires_grad=True) for n in (tq, tk, tk))
    taken = forced(monkeypatch)  # these calls are short: the cost model alone would run them eager
    assert backends_choice(spec, q) == "terms"
    got = terms.attend(q, k, v, spec)
    assert taken == ["attention"]
    want = eager.attend(q, k, v, spec, block=10**6)
    with torch.no_grad():
        torch.testing.assert_close(got, pairwise(enc, q, k, v, qp, kp, causal), rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(got)
    params = [q, k, v, *enc.parameters()]
    for g, w in zip(torch.autograd.grad(got, params, grad), torch.autograd.grad(want, params, grad)):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)


def backends_choice(spec, q) -> str:
    from posenc import backends

    with torch.enable_grad():
        return backends.choose("auto", spec, q)[0]


@pytest.mark.parametrize("causal", [False, True])
def test_the_fast_path_agrees_with_eager_in_float32_across_block_boundaries(causal, monkeypatch):
    """check_backends: 300 tokens (several band blocks of 64 and far regions), cached shapes, a
    decode step; float32 and float64, outputs and gradients of q, k, v and the parameters."""
    taken = forced(monkeypatch)  # the cached shapes are short: the cost model alone would run them eager
    enc = built(causal, 16, 64, "c2p|p2c", heads=4, dim=16)
    assert "terms" in check_backends(enc, causal)
    assert "attention" in taken


class NarrowRows(DeBERTa):
    """DeBERTa whose rows stop changing 8 distances out on each side (a narrow band), whatever its
    options say: the selection reads the rows the encoding declares, not its name or options."""

    def relative_rows(self, relative: torch.Tensor) -> torch.Tensor:
        return super().relative_rows(relative.clamp(-8, 8))


@pytest.mark.parametrize("encoding, causal, length, fast", [
    ("v3", False, 256, False),   # the default buckets' band (~1000 distances) covers every pair: eager
    ("v3", False, 512, False),
    ("v3", False, 768, True),    # measured: the band 0.82x eager's time
    ("v3", False, 2048, True),   # half the pairs are far: band + flash kernel
    ("v3", True, 256, False),    # measured: the band 1.4x eager's time (its loops' fixed costs)
    ("v3", True, 512, True),     # causal: eager writes the whole rectangle, the band half of it
    ("v3", True, 4096, True),
    ("v3", True, 64, False),     # below MIN_PAIRS: fixed costs, eager
    ("narrow", False, 512, True),  # the same options, rows that saturate early: the band is narrow
    ("narrow", False, 256, False),  # measured: fixed costs still outweigh (1.5x eager's time)
    ("narrow", False, 64, False),
])
def test_the_selection_declines_the_band_where_eager_is_cheaper(encoding, causal, length, fast):
    """auto picks ``terms``' band + far path only where its cost model beats eager (short encoder
    calls with the default buckets are eager), decided from the shapes and the declared rows; a
    forced ``terms`` runs eager's formula there (no error)."""
    from posenc import backends
    from posenc.backends import terms
    from posenc.backends.parts import disentangled
    from posenc.backends.parts.base import ScoreSpec

    cls = DeBERTa if encoding == "v3" else NarrowRows
    enc = cls(num_heads=2, head_dim=8, causal=causal)  # position_buckets=256, max_relative_positions=512
    pos = torch.arange(length)
    spec = ScoreSpec(encoding=enc, q_positions=pos, k_positions=pos, causal=causal, scale=enc.content_scale)
    q = torch.zeros(1, 2, length, 8, requires_grad=True)
    with torch.enable_grad():
        name = backends.choose("auto", spec, q)[0]
    assert name == ("terms" if fast else "eager")
    assert terms._path(spec, q) is (disentangled.attention if fast else None)
    assert terms.supports(spec, q)  # forcing terms stays allowed (it then runs the eager formula)


def test_left_padded_rows_take_the_fast_path(monkeypatch):
    """A left-padded causal call (batched generation) is split by rows, and each row's parts run the
    fast path: equal to eager with the padding mask."""
    from posenc.backends import eager, terms
    from posenc.backends.parts.base import ScoreSpec

    enc = built(True, 8, 20, "c2p|p2c").double()
    pos = torch.arange(60)
    spec = ScoreSpec(encoding=enc, q_positions=pos, k_positions=pos, causal=True, scale=enc.content_scale, starts=torch.tensor([0, 9, 41]))
    q, k, v = (torch.randn(3, 2, 60, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    taken = forced(monkeypatch)
    got = terms.attend(q, k, v, spec)
    assert taken and set(taken) == {"attention"}
    want = eager.attend(q, k, v, spec)
    real = (pos[None, :] >= spec.starts[:, None])[:, None, :, None]  # padding queries' outputs are never used
    torch.testing.assert_close(got * real, want * real, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(got) * real
    for g, w in zip(torch.autograd.grad(got, [q, k, v], grad), torch.autograd.grad(want, [q, k, v], grad)):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("buckets, max_position, pos_att_type", FAST[:4])
@pytest.mark.parametrize("padded", [False, True])
def test_a_decode_step_takes_the_fast_step_and_equals_eager(buckets, max_position, pos_att_type, padded, monkeypatch):
    """One query at the last of 70 keys, no gradient: the fast step (band written out, far keys one
    fused call); with left padding, row 2's far keys are all padding."""
    from posenc.backends import eager, terms
    from posenc.backends.parts import single
    from posenc.backends.parts.base import ScoreSpec

    enc = built(True, buckets, max_position, pos_att_type, heads=4)
    q, k, v = torch.randn(3, 4, 1, 8), torch.randn(3, 4, 70, 8), torch.randn(3, 4, 70, 8)
    pos = torch.arange(70)
    starts = torch.tensor([0, 12, 66]) if padded else None
    spec = ScoreSpec(encoding=enc, q_positions=pos[-1:], k_positions=pos, causal=True, scale=enc.content_scale, starts=starts,
                     workspace=single.Workspace(capacity=96))
    ref = ScoreSpec(encoding=enc.double(), q_positions=pos[-1:], k_positions=pos, causal=True, scale=enc.content_scale, starts=starts)
    want = eager.attend(q.double(), k.double(), v.double(), ref)
    enc.float()
    taken = spied(monkeypatch)
    with torch.no_grad():
        got = terms.attend(q, k, v, spec)
    assert taken == ["step"]
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_cached_decoding_of_the_causal_form_takes_the_fast_paths(monkeypatch):
    """An LM (causal deberta, 20 tokens past the 12-token bucket range): cached decoding token by
    token and in chunks equals the full pass, and the full pass, the cached chunks and the single
    tokens all ran the fast functions."""
    config = posenc.LMConfig(vocab_size=32, dim=32, depth=2, num_heads=4, encoding="deberta",
                             encoding_options={"position_buckets": 8, "max_relative_positions": 12})
    torch.manual_seed(5)
    taken = forced(monkeypatch)
    assert_decoding_equals_full(posenc.LM(config).eval(), backend="terms")
    assert {"attention", "step"} <= set(taken)


def test_no_quadratic_tensor_in_the_fast_backend(monkeypatch):
    """Forward and backward of one layer at N=1024 and 2048 (auto: terms): the largest tensor grows
    linearly and stays far below one head's (N, N), let alone (H, N, N); the probe sees eager's
    (B, H, N, N) scores when eager runs one block."""
    from agreement import MaxTensor
    from posenc.backends import eager
    from posenc.backends.parts import denormals
    from posenc.backends.parts.base import ScoreSpec

    def largest_tensor(length, causal):
        enc = posenc.build("deberta", num_heads=4, head_dim=16, causal=causal, position_buckets=16, max_relative_positions=64)
        layer = posenc.Attention(64, 4, enc, causal=causal)
        x = torch.randn(1, length, 64, requires_grad=True)
        with MaxTensor() as seen:
            layer(x).sum().backward()
        assert layer.last_backend == "terms"
        return seen.largest

    n = 1024
    monkeypatch.setattr(denormals.FLUSHED, "available", False)  # the kernel loops run here, where the mode sees them
    for causal in (True, False):
        largest = {length: largest_tensor(length, causal) for length in (n, 2 * n)}
        # Linear in N (band blocks, the (B, H, N, R) products), far below one head's (N, N).
        assert largest[2 * n] <= (2 * n) ** 2 // 4 and largest[2 * n] <= 2.1 * largest[n], largest
    enc = posenc.build("deberta", num_heads=4, head_dim=16, position_buckets=16, max_relative_positions=64)
    q, k, v = (torch.randn(1, 4, n, 16, requires_grad=True) for _ in range(3))
    pos = torch.arange(n)
    with MaxTensor() as seen:
        eager.attend(q, k, v, ScoreSpec(encoding=enc, q_positions=pos, k_positions=pos, causal=False, scale=enc.content_scale),
                                        block=n).sum().backward()
    assert seen.largest >= 4 * n * n


def test_a_decode_step_reuses_the_rows_and_tables_of_its_workspace(monkeypatch):
    """Decoding one token at a time with a KV cache's workspace: ``relative_rows`` runs once per
    capacity (again when the cache outgrows it) and the position tables once per parameter version
    (again after an in-place update), never per step; every step still equals eager."""
    from posenc.backends import eager, terms
    from posenc.backends.parts import single
    from posenc.backends.parts.base import ScoreSpec

    enc = built(True, 8, 20, "c2p|p2c", heads=2)
    torch.manual_seed(6)
    k, v = torch.randn(2, 2, 70, 8), torch.randn(2, 2, 70, 8)
    queries = torch.randn(80, 2, 2, 1, 8)
    calls = {"relative_rows": 0, "disentangled_tables": 0}
    originals = {name: getattr(enc, name) for name in calls}

    def counted(name):
        def call(*args):
            calls[name] += 1
            return originals[name](*args)
        return call

    ws = single.Workspace(capacity=64)
    taken = spied(monkeypatch)

    def decode(n):  # one step: the query at the last of n keys; returns the calls it made
        pos = torch.arange(n)
        with torch.no_grad():
            want = eager.attend(queries[n], k[:, :, :n], v[:, :, :n], ScoreSpec(encoding=enc, q_positions=pos[-1:], k_positions=pos, causal=True,
                                                                                scale=enc.content_scale))
            for name in calls:
                monkeypatch.setattr(enc, name, counted(name))
            before = dict(calls)
            got = terms.attend(queries[n], k[:, :, :n], v[:, :, :n], ScoreSpec(encoding=enc, q_positions=pos[-1:], k_positions=pos, causal=True,
                                                                               scale=enc.content_scale, workspace=ws))
            for name in calls:
                monkeypatch.setattr(enc, name, originals[name])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        return {name: calls[name] - before[name] for name in calls}

    assert decode(30) == {"relative_rows": 1, "disentangled_tables": 1}  # the first step builds the workspace
    for n in range(31, 60):  # far past the 20-distance bucket range: band and far keys both
        assert decode(n) == {"relative_rows": 0, "disentangled_tables": 0}, n
    with torch.no_grad():
        enc.rel_embeddings.add_(0.25)  # an optimizer step: the tables' key (parameter versions) changes
    assert decode(60) == {"relative_rows": 0, "disentangled_tables": 1}
    assert decode(61) == {"relative_rows": 0, "disentangled_tables": 0}
    assert decode(70) == {"relative_rows": 1, "disentangled_tables": 0}  # 70 keys outgrow the capacity of 64
    assert set(taken) == {"step"}


def test_deberta_v1_is_named_as_unsupported() -> None:
    config = transformers.DebertaConfig(vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                        intermediate_size=64, relative_attention=True, pos_att_type=["c2p", "p2c"],
                                        max_relative_positions=16)
    with raises("encoder: a DeBERTa-v2/v3 encoder has separate query_proj, key_proj and value_proj; this "
                "DebertaEncoder's DisentangledSelfAttention (module transformers.models.deberta.modeling_deberta) has "
                "none (DeBERTa v1 projects q, k and v with one in_proj and is not supported)"):
        posenc.hf.deberta_from_hf(transformers.DebertaModel(config))
