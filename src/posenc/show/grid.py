"""A patch grid seen from one patch: the score pattern a 2-D rotation gives over an image.

Every patch carries the same constant query and key, c = (1, ..., 1). The query is rotated at the
chosen patch p, the key at every patch n of a (height x width) grid, and the map is their cosine
similarity, per head:

    map_h(n) = cos(R_h(p) c, R_h(n) c) = (2 / D) sum_f cos(angle_{h,f}(p) - angle_{h,f}(n))

(a rotation keeps norms, and a pair (1, 1) rotated by a difference d scores 2 cos d against
itself), so the map is 1 at p itself and shows how the score of identical content falls off, and
in which directions, with the offset between two patches: axis-aligned crosses for axial RoPE,
per-head oriented stripes for RoPE-Mixed. Positions: :func:`~posenc.encodings.axial_rope.patch_positions`
for the axial methods, one (1, height, width) image, ``vision_text_positions([(1, h, w)])``, for
M-RoPE.

``grid_figure`` builds the figure on ``matplotlib.figure.Figure`` (no pyplot state); ``grid_png``
writes it, tagged like ``posenc show``'s files; ``draws`` / ``run`` are what ``posenc show`` calls
for a method with 2-D positions.

Shape legend: H heads, h x w grid, T = h * w patches.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..encodings import REGISTRY
from ..encodings.axial_rope import patch_positions
from ..encodings.base import PositionalEncoding, position_axes_of
from ..encodings.mrope import vision_text_positions
from ..encodings.protocol import Rotates, require
from ..errors import UsageError, check_int

if TYPE_CHECKING:
    from matplotlib.figure import Figure

from .inputs import build_checked, check_heads, check_out, check_seed, check_sizes, get_class_checked, write_png

MAX_SIDE = 256  # patches on each side of the grid: a panel is a few hundred pixels wide


def grid_positions(encoding: PositionalEncoding, height: int, width: int) -> torch.Tensor:
    """The positions ``encoding`` takes for an (height x width) grid, patches in row-major order.

    Raises:
        UsageError: ``encoding`` does not read several position ids per token (no grid to draw).
    """
    axes, first = position_axes_of(encoding)  # what the encoding declares it reads
    if axes == 3 and first:
        return vision_text_positions([(1, height, width)])  # (3, T): temporal 0, then (row, column)
    if axes == 2 and not first:
        return patch_positions(height, width)  # (T, 2): (column, row)
    if axes == 4 and first:  # XD-RoPE, as Hunyuan-VL's get_rope_index: (sequence index, column, row, image 0)
        xy = patch_positions(height, width).T  # (2, T)
        return torch.cat((torch.arange(height * width)[None], xy, torch.zeros(1, height * width, dtype=torch.long)))  # (4, T)
    raise UsageError(f"a grid picture needs an encoding with 2-D positions (mrope, axial_rope, rope_mixed, xdrope), got {type(encoding).__name__}")


def grid_pattern(encoding: PositionalEncoding, height: int, width: int, patch: tuple[int, int] | None = None) -> torch.Tensor:
    """(H, height, width) float32 cosine similarity between the constant vector rotated at
    ``patch`` = (column, row) (default: the centre) and rotated at every patch."""
    height, width = (check_int(n, v, 1, MAX_SIDE) for n, v in (("height", height), ("width", width)))
    col, row = (width // 2, height // 2) if patch is None else patch
    check_int("patch column", col, 0, width - 1), check_int("patch row", row, 0, height - 1)
    positions = grid_positions(encoding, height, width)  # UsageError unless a 2-D rotary method
    rotary = require(encoding, Rotates)
    at = row * width + col
    one = positions[..., at: at + 1] if position_axes_of(encoding)[1] else positions[at: at + 1]
    c = torch.ones(1, encoding.num_heads, 1, encoding.head_dim)
    with torch.no_grad():
        q, k = rotary.rotate(c, c.expand(1, -1, height * width, -1), one, positions)  # (1, H, 1, D), (1, H, T, D)
        # |q| = |k| = |c| for a rotation; XD-RoPE's map of a pair whose ids differ is not one
        sim = (q * k).sum(-1) / (q.norm(dim=-1) * k.norm(dim=-1)).clamp_min(1e-30)  # (1, H, T)
    return sim[0].view(-1, height, width).float()


def grid_figure(pattern: torch.Tensor, patch: tuple[int, int], title: str) -> Figure:
    """One panel per head of ``pattern`` (H, h, w), the chosen patch marked."""
    from matplotlib.figure import Figure

    heads = pattern.shape[0]
    cols = min(heads, 4)
    rows = math.ceil(heads / cols)
    fig = Figure(figsize=(max(2.9 * cols + 1.4, 6.0), 2.9 * rows + 0.9), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for idx, ax in enumerate(axes.flat):
        if idx >= heads:
            ax.axis("off")
            continue
        im = ax.imshow(pattern[idx].numpy(), cmap="RdBu_r", vmin=-1.0, vmax=1.0, interpolation="nearest")
        ax.plot([patch[0]], [patch[1]], marker="+", color="black", markersize=9)
        ax.set_title(f"head {idx}", fontsize=9)
        ax.set_xlabel("patch column x", fontsize=8)
        ax.set_ylabel("patch row y", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.colorbar(im, ax=axes, shrink=0.8, label="cos similarity of rotated constant q and k")
    fig.suptitle(title, fontsize=9)
    return fig


def grid_png(
    encoding: PositionalEncoding, out: Path, height: int = 16, width: int = 16, patch: tuple[int, int] | None = None,
    heads: int | None = None,
) -> tuple[Path, torch.Tensor]:
    """Draw the grid pattern of ``encoding``'s first ``heads`` heads (default min(8, H)) seen from
    ``patch`` (default: the centre) to the PNG ``out``; returns (path, the (heads, h, w) map)."""

    shown = check_heads(heads, encoding.num_heads)
    out = check_out(Path(out))
    pattern = grid_pattern(encoding, height, width, patch)[:shown]
    patch = (width // 2, height // 2) if patch is None else patch
    title = (f"{encoding.name}: score pattern over a {height} x {width} patch grid seen from patch (x={patch[0]}, y={patch[1]}), "
             f"{shown} of {encoding.num_heads} heads\ncos similarity of the same constant q and k rotated at the two patches")
    if any(True for _ in encoding.parameters()):
        title += "; learned frequencies at initialisation"
    write_png(grid_figure(pattern, patch, title), out)
    return out, pattern


def draws(method: str) -> bool:
    """True for a registered method that reads several position ids per token (its declared
    ``position_axes``; ``posenc show`` then draws a grid)."""
    return method in REGISTRY and REGISTRY[method].position_axes > 1


def run(args: argparse.Namespace, options: dict) -> int:
    """``posenc show METHOD`` for a grid method: ``length`` patches on each side, the centre patch."""
    get_class_checked(args.method)
    num_heads, head_dim = check_sizes(args.num_heads, 64 if args.head_dim is None else args.head_dim)
    side = check_int("length", args.length, 1, MAX_SIDE, " (patches on each side of the grid)")
    seed = check_seed(args.seed)
    out = Path(args.out) if args.out is not None else Path(f"posenc-show-{args.method}.png")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoding = build_checked(args.method, num_heads, head_dim, args.causal, options)
    out, pattern = grid_png(encoding, out, side, side, heads=args.heads)
    print(f"{args.method}: {pattern.shape[0]} of {num_heads} heads, {side} x {side} grid from its centre, "
          f"cos similarity in [{pattern.min():.3f}, {pattern.max():.3f}] -> {out}")
    return 0


__all__ = ["MAX_SIDE", "draws", "grid_figure", "grid_pattern", "grid_png", "grid_positions", "run"]
