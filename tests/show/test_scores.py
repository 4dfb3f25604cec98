"""What ``posenc show`` plots, re-derived by hand from each paper's formula, and how it is drawn."""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc.encodings.base import PositionalEncoding
from posenc.show.scores import block_mean, heatmap, score_map, show

H, D, T = 2, 8, 12


def unit_content(dim: int, seed: int = 3) -> torch.Tensor:
    c = torch.randn(dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return c / c.norm() * math.sqrt(dim)


def paper_sinusoid(length: int, dim: int) -> torch.Tensor:
    """PE[pos, 2i] = sin(pos / 10000^(2i/dim)), PE[pos, 2i+1] = cos(...) (Vaswani et al. §3.5), float64."""
    table = torch.zeros(length, dim, dtype=torch.float64)
    for pos in range(length):
        for i in range(dim // 2):
            angle = pos / 10000 ** (2 * i / dim)
            table[pos, 2 * i], table[pos, 2 * i + 1] = math.sin(angle), math.cos(angle)
    return table


def causal_visible(length: int) -> torch.Tensor:
    return torch.ones(length, length, dtype=torch.bool).tril()


def test_sinusoidal_change_is_the_position_term_of_the_scaled_content() -> None:
    # x_i = s c + P_i with s = sqrt(dim) (§3.4). Per head h, the score of i and j minus that of the
    # scaled content alone: (s c_h . (P_ih + P_jh) + P_ih . P_jh) / sqrt(D). The old baseline (c
    # unscaled) was off by (s^2 - 1) |c_h|^2 / sqrt(D), thousands of logits at the default sizes.
    num_heads, head_dim, length = 4, 16, 20
    dim = num_heads * head_dim
    enc = posenc.build("sinusoidal", num_heads=num_heads, head_dim=head_dim, causal=False)
    c = unit_content(dim)
    p = paper_sinusoid(length, dim)
    s = math.sqrt(dim)
    ch, ph = c.view(num_heads, head_dim), p.view(length, num_heads, head_dim).transpose(0, 1)  # (H, D), (H, T, D)
    expected = (s * (ph @ ch[:, :, None]) + s * (ch[:, None, :] @ ph.transpose(1, 2)) + ph @ ph.transpose(1, 2)) / math.sqrt(head_dim)
    got = score_map(enc, length, content=c.float())
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=2e-3)
    assert got.abs().max() < 2 * s * math.sqrt(head_dim) + head_dim  # the position term, not sqrt(dim)^2 |c|^2


def test_learned_change_is_the_table_term() -> None:
    torch.manual_seed(1)
    enc = posenc.build("learned", num_heads=H, head_dim=D, causal=True, max_positions=16)
    c = unit_content(H * D).float()
    table = enc.table.detach().double()[:T].view(T, H, D).transpose(0, 1)  # (H, T, D)
    ch = c.double().view(H, D)
    expected = (table @ ch[:, :, None] + ch[:, None, :] @ table.transpose(1, 2) + table @ table.transpose(1, 2)) / math.sqrt(D)
    got = score_map(enc, T, content=c)
    visible = causal_visible(T).expand(H, T, T)
    torch.testing.assert_close(got[visible].double(), expected[visible], rtol=0, atol=1e-5)
    assert got[~visible].isnan().all()


class ScaleOnly(PositionalEncoding):
    """An embed that multiplies the content and adds nothing positional."""

    name = "scale_only"

    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return 3.0 * x


def test_an_embed_that_only_scales_content_adds_nothing() -> None:
    # The general rule behind the sinusoidal fix: the baseline is what `embed` makes of the content
    # alone, so scaling is never mistaken for position. The old code showed 8 |c_h|^2 / sqrt(D) here.
    torch.testing.assert_close(score_map(ScaleOnly(H, D, causal=False), T), torch.zeros(H, T, T), rtol=0, atol=1e-4)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_change_from_complex_rotation(layout: str) -> None:
    # RoFormer §3.4: features pair into complex numbers z_k rotated by pos * theta_k; for the same
    # content at i and j the score is sum_k |z_k|^2 cos((i - j) theta_k) / sqrt(D).
    enc = posenc.build("rope", num_heads=H, head_dim=D, causal=False, layout=layout)
    c = unit_content(H * D)
    ch = c.view(H, D)
    if layout == "half":
        mag2 = ch[:, : D // 2] ** 2 + ch[:, D // 2 :] ** 2  # (H, D/2)
    else:
        mag2 = ch[:, 0::2] ** 2 + ch[:, 1::2] ** 2
    theta = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
    dist = (torch.arange(T)[:, None] - torch.arange(T)[None, :]).double()  # (T, T)
    expected = ((torch.cos(dist[..., None] * theta) - 1) * mag2[:, None, None, :]).sum(-1) / math.sqrt(D)
    torch.testing.assert_close(score_map(enc, T, content=c.float()).double(), expected, rtol=0, atol=1e-4)


def test_t5_map_is_its_bucket_table() -> None:
    torch.manual_seed(2)
    enc = posenc.build("t5", num_heads=H, head_dim=D, causal=False, num_buckets=8, max_distance=16)
    r = torch.arange(T)[None, :] - torch.arange(T)[:, None]  # j - i
    expected = enc.relative_attention_bias.weight.detach()[posenc.relative_position_bucket(r, bidirectional=True, num_buckets=8, max_distance=16)]
    torch.testing.assert_close(score_map(enc, T), expected.permute(2, 0, 1), rtol=0, atol=1e-6)


def test_shaw_change_is_query_times_clipped_key_vector() -> None:
    torch.manual_seed(4)
    enc = posenc.build("shaw", num_heads=H, head_dim=D, causal=False, max_relative_position=3)
    c = unit_content(H * D).float()
    index = (torch.arange(T)[None, :] - torch.arange(T)[:, None]).clamp(-3, 3) + 3  # (T, T)
    expected = torch.einsum("hd,ijd->hij", c.view(H, D), enc.key_table.detach()[index]) / math.sqrt(D)
    torch.testing.assert_close(score_map(enc, T, content=c), expected, rtol=0, atol=1e-5)


def test_transformer_xl_change_is_terms_b_c_d() -> None:
    # Dai et al. §3.3: (b) + (d) = (q_i + v) . W_R R_{i-j}, (c) = u . k_j, all / sqrt(D); (a) is content.
    torch.manual_seed(5)
    enc = posenc.build("transformer_xl", num_heads=H, head_dim=D, causal=True)
    c = unit_content(H * D)
    dist = torch.arange(T)[:, None] - torch.arange(T)[None, :]  # i - j, (T, T)
    r = paper_sinusoid(2 * T, H * D)  # rows for distances 0..2T-1; here i - j >= 0 is all that is visible
    w = enc.position_key.weight.detach().double()  # (H*D, H*D)
    keys = (r @ w.t()).view(2 * T, H, D)  # (L, H, D)
    ch, u, v = c.view(H, D), enc.u.detach().double(), enc.v.detach().double()
    visible = causal_visible(T)
    expected = torch.full((H, T, T), float("nan"), dtype=torch.float64)
    for i in range(T):
        for j in range(i + 1):
            expected[:, i, j] = (((ch + v) * keys[i - j]).sum(-1) + (u * ch).sum(-1)) / math.sqrt(D)
    got = score_map(enc, T, content=c.float())
    assert got[:, ~visible].isnan().all()
    torch.testing.assert_close(got[:, visible].double(), expected[:, visible], rtol=0, atol=1e-4)
    assert (dist[visible] >= 0).all()


# ---- the picture --------------------------------------------------------------------------------------


def test_heatmap_shares_one_symmetric_scale_and_leaves_masked_cells_transparent() -> None:
    enc = posenc.build("alibi", num_heads=4, head_dim=8, causal=True)
    scores = score_map(enc, 10)
    fig = heatmap(scores, "title", "note")
    images = [ax.images[0] for ax in fig.axes if ax.images]
    assert len(images) == 4
    vmax = float(scores.nan_to_num().abs().max())
    for im in images:
        assert (im.norm.vmin, im.norm.vmax) == pytest.approx((-vmax, vmax))  # one scale, centred at 0
        assert im.cmap.get_bad()[3] == 0  # NaN drawn transparent: the hatching behind shows
        assert im.cmap(0.5)[3] == 1 and im.cmap.name.startswith("RdBu")  # diverging, opaque data
        data = im.get_array()
        assert data.mask[~causal_visible(10)].all() and not data.mask[causal_visible(10)].any()
    assert any(ax.get_xlabel() == "key position j" for ax in fig.axes)
    assert any(ax.get_ylabel() == "query position i" for ax in fig.axes)
    assert "head 0: -2.25 to 0" in [ax.get_title() for ax in fig.axes]  # 4 heads: slope 2^-2 over 9 positions


def test_block_mean_averages_visible_cells() -> None:
    scores = torch.arange(2 * 5 * 5, dtype=torch.float32).view(2, 5, 5)
    scores[:, 0, 1:] = float("nan")
    scores[:, :2, 2:] = float("nan")
    got = block_mean(scores, 2)  # (2, 3, 3), the last block row/column padded
    assert got.shape == (2, 3, 3)
    for h in range(2):
        for a in range(3):
            for b in range(3):
                block = scores[h, 2 * a : 2 * a + 2, 2 * b : 2 * b + 2]
                seen = block[~block.isnan()]
                if seen.numel():
                    assert got[h, a, b].item() == pytest.approx(seen.mean().item())
                else:
                    assert got[h, a, b].isnan()


def test_show_titles_learned_methods_at_init_and_keeps_the_global_rng(tmp_path) -> None:
    state = torch.random.get_rng_state()
    out, scores = show("t5", length=8, num_heads=2, head_dim=4, out=tmp_path / "t5.png")
    assert torch.equal(torch.random.get_rng_state(), state)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and scores.shape == (2, 8, 8)
    import matplotlib.image

    assert matplotlib.image.imread(out).shape[2] == 4  # a real, readable PNG
    # The same seed gives the same picture; another seed other weights.
    _, again = show("t5", length=8, num_heads=2, head_dim=4, out=tmp_path / "t5.png")
    _, other = show("t5", length=8, num_heads=2, head_dim=4, seed=1, out=tmp_path / "t5.png")
    assert torch.equal(again.nan_to_num(), scores.nan_to_num()) and not torch.equal(other.nan_to_num(), scores.nan_to_num())


def test_long_maps_are_averaged_to_readable_cells(tmp_path) -> None:
    out, scores = show("alibi", length=600, num_heads=1, head_dim=4, out=tmp_path / "a.png")
    assert scores.shape == (1, 600, 600)
    fig = heatmap(scores, "t", "n")
    assert fig.axes[0].images[0].get_array().shape == (300, 300)  # 2 x 2 blocks
    assert "each cell is the mean of a 2 x 2 block" in fig._suptitle.get_text()


class Probe(PositionalEncoding):
    """Records the queries it is shown (the content vector, per head) and adds nothing."""

    name = "probe"

    def query_terms(self, q, k, q_positions, k_positions):
        self.seen = q.clone()
        return torch.zeros(q.shape[:-1] + (k.shape[-2],))


@pytest.mark.parametrize("seed", [0, 7])
def test_content_is_not_the_first_draw_of_the_weights_seed(seed: int) -> None:
    # show seeds the initial weights with `seed`; were the content drawn from the same stream, a
    # learned table's row 0 would be the content itself and every head would show a stripe at key 0.
    probe = Probe(H, D, causal=False)
    score_map(probe, 4, seed)
    content = probe.seen[0, :, 0, :].reshape(-1)  # (H*D,)
    torch.manual_seed(seed)
    first_row = torch.randn(1, H * D)[0]  # what Learned's table draws first
    assert abs(torch.nn.functional.cosine_similarity(content, first_row, dim=0)) < 0.5


def test_show_rope_scaling_draws_the_frequencies(tmp_path, capsys):
    """``posenc show rope --scaling``: a PNG of the wavelengths, from JSON text or a config.json."""
    import json

    from posenc import cli

    out = tmp_path / "yarn.png"
    block = {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 2048}
    assert cli.main(["show", "rope", "--scaling", json.dumps(block), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"rope_theta": 500000.0, "max_position_embeddings": 131072, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}}))
    assert cli.main(["show", "rope", "--scaling", str(config), "--head-dim", "128", "--out", str(tmp_path / "l3.png")]) == 0
    capsys.readouterr()
    assert cli.main(["show", "alibi", "--scaling", json.dumps(block), "--out", str(tmp_path / "x.png")]) == 2
    assert "scaling draws a RoPE scaling: method must be rope, got 'alibi'" in capsys.readouterr().err
    assert cli.main(["show", "rope", "--scaling", "{not json", "--out", str(tmp_path / "x.png")]) == 2
    assert "scaling must be a JSON object or a JSON file" in capsys.readouterr().err
    assert cli.main(["show", "rope", "--scaling", '{"rope_type": "yarn"}', "--out", str(tmp_path / "x.png")]) == 2
    assert "original_max_position_embeddings" in capsys.readouterr().err
