"""2-D axial RoPE and RoPE-Mixed (Heo et al. 2024) on patch grids: live against timm's
``RotaryEmbeddingCat`` / ``RotaryEmbeddingMixed`` (test-only references), the invariants that tie
them together, positions with an axis dimension, errors."""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc.encodings.axial_rope import AxialRoPE, RoPEMixed, patch_positions
from posenc.encodings.rope import RoPE

GRID = (3, 5)  # (height, width) patches


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


@pytest.mark.parametrize("rotate_half", [False, True])
@pytest.mark.parametrize("indexing", ["xy", "ij"])
def test_axial_matches_timm_rotary_embedding_cat(timm_sincos, rotate_half: bool, indexing: str) -> None:
    torch.manual_seed(0)
    h, w = GRID
    for head_dim, base in ((16, 100.0), (32, 10000.0)):
        ref = timm_sincos.RotaryEmbeddingCat(dim=head_dim, in_pixels=False, temperature=base, grid_indexing=indexing,
                                             rotate_half=rotate_half)
        q = rand(2, 3, h * w, head_dim)
        expect = timm_sincos.apply_rot_embed_cat(q, ref.get_embed([h, w]), half=rotate_half)
        enc = AxialRoPE(3, head_dim, base=base, layout="half" if rotate_half else "interleaved")
        pos = patch_positions(h, w) if indexing == "xy" else patch_positions(h, w).flip(-1)  # "ij": (y, x)
        got, _ = enc.rotate(q, q, pos, pos)
        assert (got - expect).abs().max() < 1e-6
        torch.testing.assert_close(enc.inv_freq[: head_dim // 4], ref.bands, rtol=2.5e-7, atol=0)


def test_mixed_matches_timm_rotary_embedding_mixed(timm_sincos) -> None:
    """Every layer's frequencies copied from timm's (2, depth, H, D/2) parameter; outputs and the
    gradient of the frequencies."""
    torch.manual_seed(0)
    h, w = GRID
    heads, head_dim, depth = 3, 16, 2
    ref = timm_sincos.RotaryEmbeddingMixed(dim=heads * head_dim, depth=depth, num_heads=heads, temperature=10.0)
    q, g = rand(2, heads, h * w, head_dim), rand(2, heads, h * w, head_dim)
    embed = ref.get_embed([h, w])  # (depth, H, N, 2D)
    (timm_sincos.apply_rot_embed_cat(q, embed[0]) * g).sum().backward()
    pos = patch_positions(h, w)
    for layer in range(depth):
        enc = RoPEMixed(heads, head_dim, base=10.0)
        with torch.no_grad():
            enc.frequencies.copy_(ref.freqs[:, layer])
        got, _ = enc.rotate(q, q, pos, pos)
        assert (got - timm_sincos.apply_rot_embed_cat(q, embed[layer])).abs().max() < 1e-6
        if layer == 0:
            (got * g).sum().backward()
            torch.testing.assert_close(enc.frequencies.grad, ref.freqs.grad[:, 0], rtol=1e-4, atol=1e-4)


def test_mixed_initialisation_is_the_papers() -> None:
    """m_k = base^(-4k/D); per head one angle a_h for the first D/4 pairs and a_h + pi/2 for the rest."""
    torch.manual_seed(0)
    enc = RoPEMixed(4, 16, base=10.0)
    fx, fy = enc.frequencies.detach().double()  # (H, F) each
    mag = 10.0 ** (-4 * torch.arange(4, dtype=torch.float64) / 16)
    torch.testing.assert_close((fx ** 2 + fy ** 2).sqrt(), mag.repeat(2).expand(4, -1), rtol=1e-6, atol=0)
    first, second = torch.atan2(fy[:, :4], fx[:, :4]), torch.atan2(fy[:, 4:], fx[:, 4:])
    assert torch.allclose(first, first[:, :1].expand(-1, 4), atol=1e-6)  # one angle per head
    turned = torch.remainder(second - first - torch.pi / 2 + torch.pi, 2 * torch.pi) - torch.pi
    assert torch.allclose(turned, torch.zeros(4, 4, dtype=torch.float64), atol=1e-6)
    assert first[:, 0].unique().numel() == 4  # the heads draw their own angles


def test_axial_is_mixed_with_one_axis_per_band() -> None:
    torch.manual_seed(0)
    axial, mixed = AxialRoPE(2, 16, base=100.0), RoPEMixed(2, 16, base=100.0)
    theta = axial.inv_freq[:4]
    zero = torch.zeros(4)
    with torch.no_grad():
        mixed.frequencies.copy_(torch.stack([torch.cat([theta, zero]), torch.cat([zero, theta])])[:, None].expand(2, 2, 8))
    q, k = rand(2, 2, 15, 16), rand(2, 2, 15, 16)
    pos = patch_positions(*GRID)
    for a, b in zip(axial.rotate(q, k, pos, pos), mixed.rotate(q, k, pos, pos)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_position_forms() -> None:
    """(T,) is the diagonal (p, p); (B, T, 2) rotates each row at its own positions; 1-D axial
    positions are RoPE with each frequency twice."""
    torch.manual_seed(0)
    q = rand(2, 2, 6, 16)
    rows = torch.stack([patch_positions(2, 3), patch_positions(3, 2)])  # (2, 6, 2)
    for enc in (AxialRoPE(2, 16), RoPEMixed(2, 16)):
        p = torch.arange(3, 9)
        assert torch.equal(enc.rotate(q, q, p, p)[0], enc.rotate(q, q, torch.stack([p, p], -1), p)[0])
        both = enc.rotate(q, q, rows, rows)[0]
        for b in range(2):
            assert torch.equal(both[b], enc.rotate(q[b:b + 1], q[b:b + 1], rows[b], rows[b])[0][0])
        assert (both[1] - enc.rotate(q, q, rows[0], rows[0])[0][1]).abs().max() > 1e-3
    rope = RoPE(2, 8, base=100.0, layout="interleaved")
    got = AxialRoPE(2, 16, base=100.0).rotate(q, q, torch.arange(6), torch.arange(6))[0]
    x = q.view(2, 2, 6, 2, 8)  # interleaved pairs: the first 8 features are the x band, the last 8 the y band
    torch.testing.assert_close(got.view(2, 2, 6, 2, 8)[..., 0, :], rope.rotate_one(x[..., 0, :], torch.arange(6)), atol=0, rtol=0)


def test_mixed_grouped_query_keys_turn_with_their_query_heads() -> None:
    """num_kv_heads=2 of 4: keys (B, 2, T, D) rotated once score as the same keys repeated per
    query head; keys of another head count are a UsageError naming the option."""
    torch.manual_seed(0)
    enc = RoPEMixed(4, 16, num_kv_heads=2)
    assert enc.frequencies.shape == (2, 2, 8)
    q, k = rand(1, 4, 15, 16), rand(1, 2, 15, 16)
    pos = patch_positions(*GRID)
    qr, kr = enc.rotate(q, k, pos, pos)
    qr2, kr2 = enc.rotate(q, k.repeat_interleave(2, 1), pos, pos)
    assert torch.equal(qr, qr2) and torch.equal(kr.repeat_interleave(2, 1), kr2)
    with pytest.raises(posenc.UsageError, match=r"rope_mixed: k has 2 heads, but the encoding was built for num_heads=4 "
                                                r"and num_kv_heads=4 \(build it with num_kv_heads=2 for grouped-query keys\)"):
        RoPEMixed(4, 16).rotate(q, k, pos, pos)
    with pytest.raises(posenc.UsageError, match="num_kv_heads must divide num_heads=4, got 3"):
        RoPEMixed(4, 16, num_kv_heads=3)


def test_compiled_rotation_equals_eager() -> None:
    """Under torch.compile the ids index the table as built (no host read, no graph break)."""
    torch.manual_seed(0)
    q = rand(2, 2, 15, 16)
    pos = patch_positions(*GRID)
    for enc in (AxialRoPE(2, 16), RoPEMixed(2, 16), posenc.build("mrope", num_heads=2, head_dim=16)):
        ids = posenc.vision_text_positions([(1, 3, 5)]) if enc.name == "mrope" else pos
        fn = torch.compile(lambda a, p: enc.rotate(a, a, p, p)[0], backend="eager", fullgraph=True)
        torch.testing.assert_close(fn(q, ids), enc.rotate(q, q, ids, ids)[0], atol=0, rtol=0)


@pytest.mark.parametrize("cls", [AxialRoPE, RoPEMixed])
def test_scores_depend_on_offsets_only(cls) -> None:
    torch.manual_seed(0)
    enc = cls(2, 16)
    q, k = rand(1, 2, 15, 16, dtype=torch.float64), rand(1, 2, 15, 16, dtype=torch.float64)
    pos = patch_positions(*GRID)

    def scores(p):
        qr, kr = enc.rotate(q, k, p, p)
        return qr @ kr.transpose(-1, -2)

    base = scores(pos)
    torch.testing.assert_close(scores(pos + torch.tensor([7, 11])), base, atol=1e-5, rtol=1e-5)
    for axis in range(2):  # each axis matters
        moved = pos.clone()
        moved[4, axis] += 1
        assert (scores(moved) - base).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["axial_rope", "rope_mixed"])
def test_runs_in_a_model(name: str) -> None:
    torch.manual_seed(0)
    model = posenc.LM(posenc.LMConfig(encoding=name, vocab_size=32, dim=32, num_heads=2, depth=2, causal=False))
    out = model(torch.randint(0, 32, (2, 10)))
    assert out.shape == (2, 10, 32) and torch.isfinite(out).all()
    encs = [b.attn.encoding for b in model.blocks]
    assert (encs[0] is encs[1]) == (name == "axial_rope")  # RoPE-Mixed learns per layer


@pytest.mark.parametrize("name", ["axial_rope", "rope_mixed"])
def test_bad_options(name: str) -> None:
    cases = [
        (dict(head_dim=14), f"{name} needs head_dim divisible by 4 (two axes of feature pairs), got 14"),
        (dict(base=0.5), "base must be > 1, got 0.5"),
        (dict(layout="spiral"), "layout must be one of ('half', 'interleaved'), got 'spiral'"),
    ]
    for options, message in cases:
        kwargs = dict(num_heads=2, head_dim=16) | options
        with pytest.raises(posenc.UsageError) as err:
            posenc.build(name, **kwargs)
        assert message in str(err.value)


@pytest.mark.parametrize("name", ["axial_rope", "rope_mixed"])
def test_bad_positions(name: str) -> None:
    enc = posenc.build(name, num_heads=2, head_dim=16)
    q = torch.zeros(2, 2, 6, 16)
    ok = patch_positions(2, 3)
    cases = [
        (torch.zeros(6, 3, dtype=torch.long), f"{name}: q_positions must have shape (6,), (6, 2) or (B, 6, 2) with B = 2; got 3 axes, {name} has 2"),
        (ok.float(), f"{name}: q_positions must be an integer tensor, got torch.float32"),
        (ok.bool(), "must be an integer tensor, got torch.bool"),
        (torch.zeros(3, 6, 2, dtype=torch.long), "with B = 2; got shape (3, 6, 2)"),
        (torch.zeros(5, 2, dtype=torch.long), "got shape (5, 2)"),
        (ok - 1, f"{name}: q_positions: positions must be >= 0, got -1"),
        ([0, 1, 2, 3, 4, 5], "must be an integer tensor, got list"),
    ]
    for positions, message in cases:
        with pytest.raises(posenc.UsageError) as err:
            enc.rotate(q, q, positions, ok)
        assert message in str(err.value), str(err.value)
    with pytest.raises(posenc.UsageError, match="height must be a positive integer"):
        patch_positions(0, 3)


def test_patch_positions_row_major() -> None:
    pos = patch_positions(2, 3)
    assert pos.tolist() == [[0, 0], [1, 0], [2, 0], [0, 1], [1, 1], [2, 1]]
