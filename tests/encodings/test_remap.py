"""The training-free position remaps (SelfExtend, ReRoPE, STRING, DCA) against a dense reference
written here from the papers' equations: each pair (i, j) gets the relative position the paper
assigns it, and the score is q_i . R(rel) k_j computed in float64 from the angles themselves
(independent of posenc's cos/sin tables and of its regions). Then the invariants: G = 1 or W >= T is
plain RoPE, a packed row equals its documents alone, a padded batch equals its rows alone, cached
decoding equals the full pass, gradients equal the reference's."""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc.errors import UsageError

pytestmark = pytest.mark.usefixtures("one_thread")
H, HKV, D, BASE = 4, 2, 16, 10000.0

CASES = [
    ("selfextend", dict(group=3, window=40)),
    ("rerope", dict(window=50)),
    ("string", dict(shift=90, local=20)),
    ("dca", dict(chunk_size=70, local_size=20)),
]


def paper_distance(name: str, opts: dict, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """The relative position of query i and key j (broadcast), as each paper defines it."""
    r = i - j
    if name == "selfextend":  # Jin et al. 2024, eq. 3-4: neighbour window W, group G
        g, w = opts["group"], opts["window"]
        return torch.where(r < w, r, (i // g + w - w // g) - j // g)
    if name == "rerope":  # Su 2023: min(r, w)
        return r.clamp(max=opts["window"])
    if name == "string":  # An et al. 2024 (STRING), eq. 5: r - S + W past the shift
        return torch.where(r >= opts["shift"], r - opts["shift"] + opts["local"], r)
    if name == "dca":  # An et al. 2024 (DCA), §3: P_k = j mod s; intra, successive, inter query maps
        c, w = opts["chunk_size"], opts["local_size"]
        s = c - w
        same, previous = i // s == j // s, i // s - j // s == 1
        successive = torch.minimum(s + i % s, torch.full_like(i, c - 1)) - j % s
        return torch.where(same, r, torch.where(previous, successive, (c - 1) - j % s))
    raise AssertionError(name)


def paper_scores(name, opts, q, k, positions):
    """q_i . R(rel(i, j)) k_j / sqrt(D) (B, H, T, T) in float64, R the half-layout rotation, k's heads repeated."""
    i, j = positions[:, None], positions[None, :]
    rel = paper_distance(name, opts, i, j).to(torch.float64)  # (T, T)
    theta = BASE ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
    angle = rel[..., None] * theta  # (T, T, D/2)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    q1, q2 = q[..., : D // 2], q[..., D // 2:]
    k1, k2 = k[..., : D // 2], k[..., D // 2:]
    # R(m) q . R(n) k = sum_f (q1 k1 + q2 k2) cos((m - n) t_f) - (q2 k1 - q1 k2) sin((m - n) t_f)
    a = q1[:, :, :, None] * k1[:, :, None] + q2[:, :, :, None] * k2[:, :, None]  # (B, H, T, T, D/2)
    b = q2[:, :, :, None] * k1[:, :, None] - q1[:, :, :, None] * k2[:, :, None]
    return (a * angle.cos() - b * angle.sin()).sum(-1) / math.sqrt(D)


def reference(name, opts, q, k, v, positions, sinks=None):
    """softmax(q_i . R(rel(i, j)) k_j / sqrt(D), causal [, sinks]) v in float64."""
    i, j = positions[:, None], positions[None, :]
    v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    s = paper_scores(name, opts, q, k, positions).masked_fill(j > i, float("-inf"))
    if sinks is not None:
        s = torch.cat((s, sinks.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)), -1)
        return torch.softmax(s, -1)[..., :-1] @ v
    return torch.softmax(s, -1) @ v


def inputs(b=2, t=240, dtype=torch.float64):
    torch.manual_seed(0)
    return (torch.randn(b, H, t, D, dtype=dtype), torch.randn(b, HKV, t, D, dtype=dtype), torch.randn(b, HKV, t, D, dtype=dtype))


def build(name, **opts):
    return posenc.build(name, num_heads=H, head_dim=D, base=BASE, **opts)


@pytest.mark.parametrize("backend", ["auto", "eager"])
@pytest.mark.parametrize("name, opts", CASES)
def test_each_remap_equals_the_papers_positions_outputs_and_gradients(name, opts, backend):
    q, k, v = (x.requires_grad_() for x in inputs())
    pos = torch.arange(q.shape[2])
    want = reference(name, opts, q, k, v, pos)
    got = posenc.attend(q, k, v, build(name, **opts).double(), backend=backend)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)  # the tables are float32 (posenc's precision rule)
    g = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name, opts", CASES)
def test_float32_on_the_kernel_and_with_sinks(name, opts):
    q, k, v = inputs(t=300)
    sinks = torch.randn(H, dtype=torch.float64)
    want = reference(name, opts, q, k, v, torch.arange(300), sinks)
    got = posenc.attend(q.float(), k.float(), v.float(), build(name, **opts), sinks=sinks.float())
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("block, small", [(32, 256), (64, 16)], ids=["blocks", "bands-recut"])
@pytest.mark.parametrize("name, opts", CASES)
def test_the_kernels_triangles_give_the_papers_gradients(name, opts, block, small, monkeypatch):
    """Past one block of queries the regions' edges run on the flash kernel as causal or flipped
    triangles (a block whose band is narrower than it is cut into small blocks first): outputs and
    gradients in float32 still equal the float64 reference."""
    from posenc.backends.parts import remapped

    monkeypatch.setattr(remapped, "BLOCK", block)
    monkeypatch.setattr(remapped, "EAGER_BLOCK", small)
    kinds: set[str] = set()
    plan = remapped._plan

    def seen(*args):
        out = plan(*args)
        kinds.update(piece[3] for _, _, pieces in out["blocks"] for piece in pieces)
        return out

    monkeypatch.setattr(remapped, "_plan", seen)
    q, k, v = (x.requires_grad_() for x in inputs(t=300))
    want = reference(name, opts, q, k, v, torch.arange(300))
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    got = posenc.attend(q32, k32, v32, build(name, **opts))
    assert {"causal", "full"} <= kinds and ("flipped" in kinds or name in ("string", "dca")), kinds  # (no band wider than a block)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)
    g = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, (q32, k32, v32), g.float()), torch.autograd.grad(want, (q, k, v), g)):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=5e-5)


def test_the_paper_maps_differ_from_rope_where_they_should():
    """The reference is not RoPE in disguise: past the window the outputs differ by order one."""
    q, k, v = inputs()
    rope = posenc.attend(q, k, v, posenc.build("rope", num_heads=H, head_dim=D, base=BASE).double())
    for name, opts in CASES:
        assert (posenc.attend(q, k, v, build(name, **opts).double()) - rope).abs().max() > 0.1, name


@pytest.mark.parametrize("name, opts", [("selfextend", dict(group=1, window=8)), ("selfextend", dict(group=4, window=240)),
                                        ("rerope", dict(window=240)), ("string", dict(shift=240, local=3)),
                                        ("dca", dict(chunk_size=300, local_size=50))])
def test_group_one_or_a_window_past_the_length_is_plain_rope(name, opts):
    q, k, v = inputs()
    rope = posenc.attend(q, k, v, posenc.build("rope", num_heads=H, head_dim=D, base=BASE).double())
    torch.testing.assert_close(posenc.attend(q, k, v, build(name, **opts).double()), rope, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name, opts", CASES)
def test_a_packed_row_equals_its_documents_alone(name, opts):
    q, k, v = inputs(b=1)
    cut = 130
    doc = torch.tensor([[0] * cut + [1] * (240 - cut)])
    enc = build(name, **opts).double()
    packed = posenc.attend(q, k, v, enc, document_ids=doc)
    alone = torch.cat([posenc.attend(q[:, :, s], k[:, :, s], v[:, :, s], enc) for s in (slice(0, cut), slice(cut, 240))], 2)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name, opts", CASES)
def test_a_left_padded_batch_equals_its_rows_alone(name, opts):
    q, k, v = inputs()
    pad = 37
    mask = torch.ones(2, 240, dtype=torch.bool)
    mask[1, :pad] = False
    enc = build(name, **opts).double()
    out = posenc.attend(q, k, v, enc, key_padding_mask=mask)
    alone = posenc.attend(q[1:, :, pad:], k[1:, :, pad:], v[1:, :, pad:], enc)
    torch.testing.assert_close(out[1:, :, pad:], alone, rtol=0, atol=1e-12)
    torch.testing.assert_close(out[:1], posenc.attend(q[:1], k[:1], v[:1], enc), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name, opts", CASES)
def test_cached_decoding_equals_the_full_pass_with_windows_and_left_padding(name, opts):
    torch.manual_seed(1)
    lm = posenc.LM(posenc.LMConfig(encoding=name, encoding_options=opts, dim=32, depth=2, num_heads=4, num_kv_heads=2)).eval()
    tokens = torch.randint(0, 256, (2, 170))
    with torch.no_grad():
        full = lm(tokens)
        cache = lm.new_cache(batch_size=2)
        steps = [lm(tokens[:, :61], cache=cache)] + [lm(tokens[:, t:t + 1], cache=cache) for t in range(61, 170)]
        torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-4)
        # a left-padded cache: row 1 is padded by 9 tokens and must equal its own prompt alone
        cache = lm.new_cache(batch_size=2, padding=[0, 9])
        padded = torch.cat([tokens[:1, :100], torch.cat([tokens[1:, :9] * 0, tokens[1:, :91]], 1)])
        first = lm(padded, cache=cache)
        step = lm(tokens[:, 100:101], cache=cache)
        alone = lm(torch.cat([tokens[1:, :91], tokens[1:, 100:101]], 1))
        torch.testing.assert_close(first[1:, 9:], alone[:, :91], rtol=0, atol=1e-4)
        torch.testing.assert_close(step[1:, -1], alone[:, -1], rtol=0, atol=1e-4)


@pytest.mark.parametrize("name, opts", CASES)
def test_kept_rotated_keys_follow_a_cropped_and_rewritten_cache(name, opts):
    """Decode steps keep each far region's rotated keys; a cache cropped and refilled with other tokens
    (speculative decoding), or another prompt in the same cache, must not reuse stale rows."""
    torch.manual_seed(2)
    lm = posenc.LM(posenc.LMConfig(encoding=name, encoding_options=opts, dim=32, depth=2, num_heads=4, num_kv_heads=2)).eval()
    a, b = torch.randint(0, 256, (1, 200)), torch.randint(0, 256, (1, 200))
    with torch.no_grad():
        cache = lm.new_cache(batch_size=1)
        lm(a[:, :150], cache=cache)
        for t in range(150, 170):
            lm(a[:, t:t + 1], cache=cache)
        cache.crop(155)  # forget 15 tokens, then continue with other ones
        other = torch.cat([a[:, :155], b[:, :30]], 1)
        steps = [lm(other[:, t:t + 1], cache=cache) for t in range(155, 185)]
        torch.testing.assert_close(torch.cat(steps, 1), lm(other)[:, 155:], rtol=0, atol=1e-4)
        cache.reset()  # a new prompt in the same cache
        first = lm(b[:, :120], cache=cache)
        steps = [first[:, -1:]] + [lm(b[:, t:t + 1], cache=cache) for t in range(120, 160)]
        torch.testing.assert_close(torch.cat(steps, 1), lm(b[:, :160])[:, 119:], rtol=0, atol=1e-4)


@pytest.mark.parametrize("name, opts", CASES)
def test_a_sliding_window_layer_narrows_every_region(name, opts):
    q, k, v = inputs()
    enc = build(name, **opts).double()
    window = 60
    got = posenc.attend(q, k, v, enc, window=window)
    pos = torch.arange(240)
    i, j = pos[:, None], pos[None, :]  # the window as one more mask: rel only matters inside it
    s = paper_scores(name, opts, q, k, pos).masked_fill((j > i) | (j <= i - window), float("-inf"))
    want = torch.softmax(s, -1) @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)


def test_a_soft_cap_bends_the_content_scores_of_every_region():
    """Gemma 2's cap on q . k * scale, before the mask: against the reference with the cap, outputs and gradients."""
    q, k, v = (x.requires_grad_() for x in inputs(t=120))
    name, opts = CASES[0]
    enc = build(name, **opts).double()
    got = posenc.attend(q, k, v, enc, softcap=0.5)
    pos = torch.arange(120)
    i, j = pos[:, None], pos[None, :]
    s = torch.tanh(paper_scores(name, opts, q, k, pos) / 0.5) * 0.5
    want = torch.softmax(s.masked_fill(j > i, float("-inf")), -1) @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    g = torch.randn_like(want)
    for x, y in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5)


def test_bad_options_and_calls_are_usage_errors():
    with pytest.raises(UsageError, match="group"):
        build("selfextend", group=0)
    with pytest.raises(UsageError, match="window"):
        build("rerope", window=-1)
    with pytest.raises(UsageError, match="local"):
        build("string", shift=10, local=11)
    with pytest.raises(UsageError, match="local_size"):
        build("dca", chunk_size=10, local_size=10)
    with pytest.raises(UsageError, match="scaling"):
        build("selfextend", scaling={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 64})
    with pytest.raises(UsageError):
        posenc.build("selfextend", num_heads=H, head_dim=D, causal=False)
    q, k, v = inputs(t=20)
    with pytest.raises(UsageError, match="backend"):
        posenc.attend(q, k, v, build("dca").double(), backend="sdpa")


def test_a_yarn_scaled_rope_is_remapped_with_its_own_frequencies():
    """The remap rotates with the RoPE it was given (here YaRN's), so within the neighbour window it
    equals that RoPE."""
    q, k, v = inputs(t=64)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    plain = posenc.attend(q, k, v, posenc.build("rope", num_heads=H, head_dim=D, base=BASE, scaling=yarn).double())
    torch.testing.assert_close(posenc.attend(q, k, v, build("selfextend", group=2, window=64, scaling=yarn).double()), plain,
                               rtol=0, atol=1e-12)
