"""posenc.show.grid: the score pattern of a 2-D rotation seen from one patch, and its PNG."""

from __future__ import annotations

import argparse

import pytest
import torch

import posenc
from posenc.show import grid as grid_plot
from posenc.show.inputs import PNG_SIGNATURE

# The methods that read several position ids per token (``position_axes`` > 1): posenc show draws
# each of them as a grid.
MULTI_AXIS = [n for n in posenc.available() if posenc.encodings.get_class(n).position_axes > 1]
assert {"axial_rope", "rope_mixed", "mrope"} <= set(MULTI_AXIS), MULTI_AXIS


def test_show_draws_every_multi_axis_method_as_a_grid() -> None:
    assert [n for n in posenc.available() if grid_plot.draws(n)] == MULTI_AXIS


@pytest.mark.parametrize("name", MULTI_AXIS)
def test_writes_a_png(tmp_path, name: str) -> None:
    torch.manual_seed(0)
    enc = posenc.build(name, num_heads=3, head_dim=16)
    out, pattern = grid_plot.grid_png(enc, tmp_path / "grid.png", height=6, width=7, patch=(2, 4))
    assert out.read_bytes().startswith(PNG_SIGNATURE) and out.stat().st_size > 5000
    assert pattern.shape == (3, 6, 7)
    torch.testing.assert_close(pattern[:, 4, 2], torch.ones(3), atol=1e-6, rtol=0)  # the patch itself
    assert (pattern <= 1 + 1e-6).all() and (pattern < 0.999).any()


def test_pattern_is_the_formula() -> None:
    """Axial RoPE: map(n) = (1/F) sum_f cos(angle_f(p) - angle_f(n)), written out in float64."""
    enc = posenc.build("axial_rope", num_heads=1, head_dim=16, base=100.0)
    got = grid_plot.grid_pattern(enc, 5, 6, patch=(1, 3))[0]
    theta = 100.0 ** (-4 * torch.arange(4, dtype=torch.float64) / 16)
    y, x = torch.meshgrid(torch.arange(5.0, dtype=torch.float64), torch.arange(6.0, dtype=torch.float64), indexing="ij")
    expect = (torch.cos((x[..., None] - 1) * theta).sum(-1) + torch.cos((y[..., None] - 3) * theta).sum(-1)) / 8
    torch.testing.assert_close(got.double(), expect, atol=1e-6, rtol=0)


def test_run_is_what_show_calls(tmp_path, capsys) -> None:
    assert grid_plot.draws("rope_mixed") and grid_plot.draws("mrope") and not grid_plot.draws("rope")
    args = argparse.Namespace(method="axial_rope", num_heads=2, head_dim=16, length=8, seed=0, causal=False, heads=None,
                              out=tmp_path / "a.png")
    assert grid_plot.run(args, {"base": 50.0}) == 0
    assert "axial_rope: 2 of 2 heads, 8 x 8 grid from its centre" in capsys.readouterr().out
    assert (tmp_path / "a.png").read_bytes().startswith(PNG_SIGNATURE)
    args.length = 300
    with pytest.raises(posenc.UsageError, match=r"length must be an integer in \[1, 256\] \(patches on each side of the grid\), got 300"):
        grid_plot.run(args, {})


def test_errors(tmp_path) -> None:
    with pytest.raises(posenc.UsageError, match="a grid picture needs an encoding with 2-D positions"):
        grid_plot.grid_pattern(posenc.build("rope", num_heads=1, head_dim=8), 4, 4)
    enc = posenc.build("axial_rope", num_heads=1, head_dim=8)
    with pytest.raises(posenc.UsageError, match=r"patch column must be an integer in \[0, 3\], got 4"):
        grid_plot.grid_pattern(enc, 4, 4, patch=(4, 0))
    with pytest.raises(posenc.UsageError, match=r"height must be an integer in \[1, 256\], got 0"):
        grid_plot.grid_pattern(enc, 0, 4)
    with pytest.raises(posenc.UsageError, match="out must be a file name ending in .png"):
        grid_plot.grid_png(enc, tmp_path / "grid.jpg")
