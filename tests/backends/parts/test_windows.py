"""Sliding windows, chunked attention, attention sinks and per-query scales (posenc.backends.parts.windows,
posenc.encodings.query_scale), against the formulas written out here in float64: the dense (Tq, Tk) mask,
the softmax with one more logit per head, the scale factor per position."""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from agreement import MaxTensor
from posenc import backends
from posenc.backends.parts.windows import Extras, plan
from posenc.encodings.base import content_scale
from posenc.encodings.protocol import Biases, Curves, Embeds, Gates, QueryTerms, Remaps, Rotates, Selects, ValueTerms, offers
from posenc.encodings.query_scale import LogFloorScale, ScalableSoftmax, Temperature, parse_query_scale
from posenc.errors import UsageError

pytestmark = pytest.mark.usefixtures("one_thread")
H, D = 4, 16
ATTENTION_METHODS = [m for m in posenc.available()  # gated encodings (FoX), curves (Inkling) and selective attention take no window: a UsageError
                     if not any(offers(posenc.build(m, num_heads=H, head_dim=D), c) for c in (Embeds, Gates, Curves, Selects))]


def allowed(qp: torch.Tensor, kp: torch.Tensor, causal: bool, window=None, chunk=None) -> torch.Tensor:
    """The dense mask, pair by pair as the definitions say it."""
    out = torch.zeros(len(qp), len(kp), dtype=torch.bool)
    for a, i in enumerate(qp.tolist()):
        for b, j in enumerate(kp.tolist()):
            ok = j <= i if causal else True
            if window is not None:
                ok = ok and ((i - window < j) if causal else abs(i - j) <= window // 2)
            if chunk is not None:
                ok = ok and i // chunk == j // chunk
            out[a, b] = ok
    return out


def reference(enc, q, k, v, qp, kp, causal, window=None, chunk=None, sinks=None, factor=None):
    """softmax(q k^T / sqrt(D) + bias + query_terms + mask [, sink]) v + value_terms, whole; a position
    remap's scores are each pair's region's rotated q . k."""
    scale = content_scale(enc, q.shape[-1])  # of the projections' width: PoPE's rotation widens q and k
    if offers(enc, Rotates):
        q, k = enc.rotate(q, k, qp, kp)
    if factor is not None:
        q = q * factor[:, None]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    if offers(enc, Remaps):
        s = torch.full((q.shape[0], q.shape[1], len(qp), len(kp)), float("-inf"), dtype=q.dtype)
        for region in enc.regions(qp, kp):
            inside = (kp[None, :] >= region.low[:, None]) & (kp[None, :] < region.high[:, None])  # (Tq, Tk)
            scores = enc.rotate_at(q, region.q_at) @ enc.rotate_at(k, region.k_at).transpose(-1, -2) / q.shape[-1] ** 0.5
            s = torch.where(inside, scores, s)
    else:
        s = q @ k.transpose(-1, -2) * scale  # 1/sqrt(D) unless the encoding says otherwise
    if offers(enc, Biases):
        s = s + enc.bias(qp, kp)
    if offers(enc, QueryTerms):
        s = s + enc.query_terms(q, k, qp, kp)
    s = s.masked_fill(~allowed(qp, kp, causal, window, chunk), float("-inf"))
    if sinks is not None:
        e = torch.exp(s - s.amax(-1, keepdim=True).clamp(min=sinks.max()))
        z = torch.exp(sinks.view(1, -1, 1, 1) - s.amax(-1, keepdim=True).clamp(min=sinks.max()))
        p = e / (e.sum(-1, keepdim=True) + z)
    else:
        p = torch.softmax(s, -1)
    out = p @ v
    if offers(enc, ValueTerms):
        out = out + enc.value_terms(p, qp, kp)
    return out


def grads(out, tensors, g):
    return torch.autograd.grad(out, tensors, g, allow_unused=True)


def inputs(b, tq, tk, hkv=H):
    q = torch.randn(b, H, tq, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, hkv, tk, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, hkv, tk, D, dtype=torch.float64, requires_grad=True)
    return q, k, v


KINDS = [dict(window=16), dict(window=70), dict(chunk=32), dict(sinks=True), dict(window=24, sinks=True), dict(chunk=50, sinks=True)]


@pytest.mark.parametrize("method", ATTENTION_METHODS)
@pytest.mark.parametrize("causal", [True, False])
def test_every_encoding_equals_the_formula_with_the_dense_mask(method, causal):
    """Outputs and gradients (q, k, v, the encoding's parameters, the sinks) in float64, T = 150."""
    try:
        enc = posenc.build(method, num_heads=H, head_dim=D, causal=causal).double()
    except UsageError:
        pytest.skip(f"{method} has no bidirectional form")
    for kind in KINDS:
        torch.manual_seed(len(kind))
        q, k, v = inputs(2, 150, 150)
        sinks = torch.randn(H, dtype=torch.float64, requires_grad=True) if kind.get("sinks") else None
        opts = {**kind, "sinks": sinks}
        pos = torch.arange(150)
        g = torch.randn(2, H, 150, D, dtype=torch.float64)
        params = [q, k, v, *enc.parameters()] + ([sinks] if sinks is not None else [])
        got = posenc.attend(q, k, v, enc, causal=causal, **opts)
        want = reference(enc, q, k, v, pos, pos, causal, kind.get("window"), kind.get("chunk"), sinks)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10, msg=lambda m: f"{method} {kind}: {m}")
        for a, b_ in zip(grads(got, params, g), grads(want, params, g)):
            if a is None and b_ is None:
                continue
            torch.testing.assert_close(a, b_, rtol=0, atol=1e-9, msg=lambda m: f"{method} {kind} grad: {m}")


@pytest.mark.parametrize("backend", ["sdpa", "blocked", "terms", "eager", "features", "contextual"])
def test_every_backend_runs_the_plain_blocks(backend):
    """A forced backend runs the blocks it supports (chunks, the uncut start of a window); the result
    is the formula's; a backend that cannot run the encoding is a UsageError, as without a window."""
    methods = {"sdpa": "rope", "blocked": "alibi", "terms": "shaw", "eager": "t5", "features": "sandwich", "contextual": "cope"}
    enc = posenc.build(methods[backend], num_heads=H, head_dim=D).double()
    q, k, v = inputs(1, 120, 120)
    pos = torch.arange(120)
    for kind in (dict(chunk=40), dict(window=50)):
        got = posenc.attend(q, k, v, enc, backend=backend, **kind)
        want = reference(enc, q, k, v, pos, pos, True, kind.get("window"), kind.get("chunk"))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_grouped_heads_positions_offset_and_cached_steps():
    """GQA (H = 2 Hkv), positions that start at 100, a cached call (Tq < Tk) and one decode step."""
    enc = posenc.build("rope", num_heads=H, head_dim=D).double()
    for tq, tk in ((90, 90), (37, 90), (1, 90)):
        q, k, v = inputs(2, tq, tk, hkv=2)
        kp = torch.arange(100, 100 + tk)
        qp = kp[tk - tq :]
        for kind in (dict(window=20), dict(chunk=32), dict(window=20, sinks=torch.randn(H, dtype=torch.float64))):
            with torch.no_grad():
                got = posenc.attend(q, k, v, enc, positions=qp, k_positions=kp, **kind)
                want = reference(enc, q, k, v, qp, kp, True, kind.get("window"), kind.get("chunk"), kind.get("sinks"))
            torch.testing.assert_close(got, want, rtol=0, atol=1e-10, msg=lambda m: f"({tq}, {tk}) {kind}: {m}")


def test_packed_documents_and_padded_rows_take_windows_per_document():
    """A packed row equals its documents alone, a padded row itself alone, with a window."""
    enc = posenc.build("alibi", num_heads=H, head_dim=D).double()
    q, k, v = inputs(2, 60, 60)
    docs = torch.tensor([[0] * 25 + [1] * 35, [0] * 60])
    with torch.no_grad():
        out = posenc.attend(q, k, v, enc, document_ids=docs, window=10)
        first = posenc.attend(q[:1, :, :25], k[:1, :, :25], v[:1, :, :25], enc, window=10)
        second = posenc.attend(q[:1, :, 25:], k[:1, :, 25:], v[:1, :, 25:], enc, window=10)
        torch.testing.assert_close(out[:1], torch.cat((first, second), 2), rtol=0, atol=1e-12)
        mask = torch.ones(2, 60, dtype=torch.bool)
        mask[1, :12] = False  # left padding
        out = posenc.attend(q, k, v, enc, key_padding_mask=mask, window=10)
        alone = posenc.attend(q[1:, :, 12:], k[1:, :, 12:], v[1:, :, 12:], enc, window=10)
        torch.testing.assert_close(out[1:, :, 12:], alone, rtol=0, atol=1e-12)
        assert out[1, :, :12].abs().max() == 0


def test_a_window_never_builds_the_full_score_matrix():
    """N = 1024, W = 64: the largest tensor of forward + backward is O(N x W), far below N^2 / 4
    (and the check can see the full call's (H, N, N) scores)."""
    n = 1024
    for method in ("rope", "alibi"):
        layer = posenc.Attention(H * D, H, posenc.build(method, num_heads=H, head_dim=D), window=64)
        x = torch.randn(1, n, H * D, requires_grad=True)
        with MaxTensor() as seen:
            layer(x).sum().backward()
        assert seen.largest < n * n // 4, (method, seen.largest)
    full = posenc.Attention(H * D, H, posenc.build("alibi", num_heads=H, head_dim=D), backend="eager")
    with MaxTensor() as seen:
        full(torch.randn(1, 256, H * D))
    assert seen.largest >= H * 256 * 256


def test_plan_blocks():
    """Chunks give one plain block per chunk; a window's blocks are plain until the window cuts."""
    qv = list(range(100))
    blocks = plan(qv, qv, Extras(chunk=30), True)
    assert [(a, b, k0, k1, p) for a, b, k0, k1, p in blocks] == [(0, 30, 0, 30, True), (30, 60, 30, 60, True),
                                                                  (60, 90, 60, 90, True), (90, 100, 90, 100, True)]
    blocks = plan(qv, qv, Extras(window=10), True)
    assert blocks[0] == (0, 10, 0, 10, True)
    assert all(not p for *_, p in blocks[1:])
    assert all(k1 - k0 <= (b - a) + 9 for a, b, k0, k1, _ in blocks)
    assert plan([99], qv, Extras(window=10), True) == [(0, 1, 90, 100, True)]  # a decode step: the last W keys


def test_cached_decoding_past_the_window_equals_the_full_pass():
    """An LM with windowed, chunked, sink and temperature layers: token-by-token decoding through
    the KV cache gives the full pass's logits, well past the window and across chunk boundaries."""
    from posenc.model.lm import LM, LMConfig

    cfg = LMConfig(dim=32, num_heads=4, depth=4, num_kv_heads=2,
                   schedule="1x[rope window=8 sinks] 1x[alibi window=5] 1x[nope temp=0.5/4] 1x[rope:layout=interleaved chunk=16]")
    model = LM(cfg).double().eval()
    for block in model.blocks:
        if block.attn.sinks is not None:
            torch.nn.init.normal_(block.attn.sinks)
    tokens = torch.randint(0, 256, (2, 50))
    with torch.no_grad():
        full = model(tokens)
        for first in (1, 13):
            cache = model.new_cache(2)
            parts = [model(tokens[:, :first], cache)] + [model(tokens[:, t : t + 1], cache) for t in range(first, 50)]
            torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-12)


def test_query_scales_are_their_formulas():
    p = torch.arange(0, 40000, 37)
    t = Temperature(0.1, 8192).factor(p)
    want = torch.tensor([1 + 0.1 * math.log1p(math.floor((i + 1) / 8192)) for i in p.tolist()], dtype=torch.float64)
    torch.testing.assert_close(t, want, rtol=0, atol=1e-15)
    b = LogFloorScale(0.1, 16384).factor(p)
    want = torch.tensor([1 + 0.1 * math.log(1 + math.floor(i / 16384)) for i in p.tolist()], dtype=torch.float64)
    torch.testing.assert_close(b, want, rtol=0, atol=1e-15)
    s = ScalableSoftmax(0.43).factor(p)
    torch.testing.assert_close(s, torch.tensor([0.43 * math.log(i + 1) for i in p.tolist()], dtype=torch.float64), rtol=0, atol=1e-13)
    assert parse_query_scale("temp", "0.1/8192") == Temperature(0.1, 8192)
    with pytest.raises(UsageError, match="floor_scale"):
        Temperature(0.1, 0)
    with pytest.raises(UsageError, match="temp="):
        parse_query_scale("temp", "0.1")


def test_a_query_scale_multiplies_each_query_by_its_positions_factor():
    """Llama 4's temperature with positions that include a cache offset (queries at 5000..5059,
    floor_scale 16 so the factor changes inside the call), on NoPE and RoPE."""
    scale = Temperature(0.3, 16)
    for method in ("nope", "rope"):
        enc = posenc.build(method, num_heads=H, head_dim=D).double()
        q, k, v = inputs(1, 60, 200)
        kp = torch.arange(4860, 5060)
        qp = kp[-60:]
        g = torch.randn(1, H, 60, D, dtype=torch.float64)
        got = posenc.attend(q, k, v, enc, positions=qp, k_positions=kp, query_scale=scale)
        want = reference(enc, q, k, v, qp, kp, True, factor=scale.factor(qp))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
        for a, b in zip(grads(got, [q, k, v], g), grads(want, [q, k, v], g)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_sinks_lower_every_weight_as_the_sigmoid_of_lse_minus_sink():
    """out = plain attention out * sigmoid(lse - s_h): the closed form, and a very low sink is no sink."""
    enc = posenc.build("nope", num_heads=H, head_dim=D).double()
    q, k, v = inputs(1, 30, 30)
    sinks = torch.randn(H, dtype=torch.float64)
    with torch.no_grad():
        got = posenc.attend(q, k, v, enc, sinks=sinks)
        s = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(torch.ones(30, 30, dtype=torch.bool).triu(1), float("-inf"))
        lse = torch.logsumexp(s, -1, keepdim=True)
        want = (torch.softmax(s, -1) @ v) * torch.sigmoid(lse - sinks.view(1, H, 1, 1))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        none = posenc.attend(q, k, v, enc, sinks=torch.full((H,), -1e4, dtype=torch.float64))
        torch.testing.assert_close(none, posenc.attend(q, k, v, enc), rtol=0, atol=1e-12)


def test_bad_arguments_name_themselves():
    q, k, v = inputs(1, 8, 8)
    with pytest.raises(UsageError, match="window"):
        posenc.attend(q, k, v, window=0)
    with pytest.raises(UsageError, match="not both"):
        posenc.attend(q, k, v, window=4, chunk=4)
    with pytest.raises(UsageError, match="sinks"):
        posenc.attend(q, k, v, sinks=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(UsageError, match="chunk"):
        posenc.Attention(64, 4, posenc.build("rope", num_heads=4, head_dim=16), chunk=-1)


def test_auto_picks_the_usual_backend_for_plain_blocks():
    """A chunked RoPE layer runs its chunks through sdpa (the fused kernel), not the block formula."""
    layer = posenc.Attention(H * D, H, posenc.build("rope", num_heads=H, head_dim=D), chunk=32)
    layer(torch.randn(1, 100, H * D))
    assert layer.last_backend == "sdpa"
    assert "sdpa" in backends.BACKENDS


# ---- the KV cache of a windowed layer ------------------------------------------------------------


def _windowed_model():
    from posenc.model.lm import LM, LMConfig

    cfg = LMConfig(dim=32, num_heads=4, depth=3, num_kv_heads=2, schedule="[rope window=6] [alibi window=4 sinks] [t5]")
    model = LM(cfg).double().eval()
    torch.nn.init.normal_(model.blocks[1].attn.sinks)
    return model


def test_a_windowed_cache_keeps_o_w_keys_and_decodes_exactly():
    """Prompt of 40 (> 2W) then 160 steps, and uneven chunks: logits equal the full pass; the
    windowed layers hold buffers of max(2W, 16) slots, a longer chunk's size only until the next
    compaction (the full layer holds every key)."""
    model = _windowed_model()
    tokens = torch.randint(0, 256, (2, 200))
    with torch.no_grad():
        full = model(tokens)
        for chunks in ([40] + [1] * 160, [7, 1, 5, 30, 2] * 3 + [1] * 65):
            cache = model.new_cache(2, capacity=200)
            parts, at = [], 0
            for n in chunks:
                parts.append(model(tokens[:, at : at + n], cache))
                at += n
                for layer, w in zip(cache.layers, (6, 4)):
                    assert layer.held <= layer.capacity <= max(2 * w, 16, w - 1 + n), (layer.held, layer.capacity, n)
            torch.testing.assert_close(torch.cat(parts, 1), full[:, :at], rtol=0, atol=1e-12)
            assert [layer.capacity for layer in cache.layers[:2]] == [16, 16]  # back from the prompt's 40
            assert cache.layers[0].start > 150 and cache.layers[2].start == 0 and cache.layers[2].held == at


def test_a_windowed_cache_with_left_padding_equals_each_row_alone():
    model = _windowed_model()
    tokens = torch.randint(0, 256, (2, 30))
    with torch.no_grad():
        cache = model.new_cache(2, padding=[0, 4])
        padded = tokens.clone()
        padded[1, :4] = 0
        steps = [model(padded[:, :10], cache)] + [model(padded[:, t : t + 1], cache) for t in range(10, 30)]
        got = torch.cat(steps, 1)
        alone = model(tokens[1:, 4:])
        # RoPE rotates in float32 at shifted positions: equal to float32 rounding, not to 1e-12
        torch.testing.assert_close(got[1:, 4:], alone, rtol=0, atol=1e-6)
        unpadded = model(tokens[:1])
        torch.testing.assert_close(got[:1], unpadded, rtol=0, atol=1e-12)


def test_crop_keeps_only_what_a_windowed_cache_still_has():
    model = _windowed_model()
    tokens = torch.randint(0, 256, (1, 60))
    with torch.no_grad():
        cache = model.new_cache(1)
        for t in range(60):
            model(tokens[:, t : t + 1], cache)
        start = max(layer.start + layer.window - 1 for layer in cache.layers[:2])
        with pytest.raises(UsageError, match="crop length"):
            cache.crop(start - 1)
        assert cache.length == 60  # nothing cropped by the refused call
        cache.crop(start)
        out = model(tokens[:, start : start + 1], cache)
        torch.testing.assert_close(out, model(tokens[:, : start + 1])[:, -1:], rtol=0, atol=1e-12)


def test_a_windowed_cache_under_autograd_trims_too():
    from posenc.model.cache import LayerCache

    cache = LayerCache(window=4)
    for t in range(10):
        k = torch.full((1, 1, 1, 2), float(t), requires_grad=True)
        ks, _ = cache.append(k, k)
    assert ks[0, 0, :, 0].tolist() == [6.0, 7.0, 8.0, 9.0] and cache.start == 6
    assert [int(p) for p in cache.positions(torch.device("cpu"))] == [6, 7, 8, 9]


@pytest.mark.parametrize("method", ["t5", "alibi", "rope"])
def test_float32_fused_path_with_bias_and_sinks_matches_float64(method):
    """The fused path (a bias as SDPA's additive mask, each sink one more zero key) in float32:
    output and gradients of q, k, v, the encoding's parameters and the sinks to 1e-5 of float64."""
    enc64 = posenc.build(method, num_heads=H, head_dim=D).double()
    enc32 = posenc.build(method, num_heads=H, head_dim=D)
    enc32.load_state_dict({k: v.float() for k, v in enc64.state_dict().items()})
    q, k, v = inputs(2, 130, 130, hkv=2)
    sinks = torch.randn(H, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, H, 130, D, dtype=torch.float64)
    want = posenc.attend(q, k, v, enc64, window=40, sinks=sinks)
    wants = grads(want, [q, k, v, sinks, *enc64.parameters()], g)
    x32 = [t.detach().float().requires_grad_() for t in (q, k, v, sinks)]
    got = posenc.attend(*x32[:3], enc32, window=40, sinks=x32[3])
    gots = grads(got, [*x32, *enc32.parameters()], g.float())
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    for a, b in zip(gots, wants):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-5 * max(1.0, b.abs().max().item()))


def test_xpos_in_a_windowed_cache_rotates_its_kept_keys_afresh():
    """xPos (centred: its rotation depends on the length) keeps its own cache frame in a full layer;
    a windowed layer forgets rows, so its kept keys are rotated afresh each step: both decode as the
    full pass (xPos rotates in float32)."""
    from posenc.model.lm import LM, LMConfig

    model = LM(LMConfig(dim=32, num_heads=4, depth=2, schedule="[xpos window=5] [xpos]")).double().eval()
    assert model.blocks[0].attn.encoding.rotation_depends_on_length
    tokens = torch.randint(0, 256, (2, 60))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(2)
        parts = [model(tokens[:, :10], cache)] + [model(tokens[:, t : t + 1], cache) for t in range(10, 60)]
    assert cache.layers[0].start > 0
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-8)
