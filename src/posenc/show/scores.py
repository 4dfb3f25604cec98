"""``posenc show METHOD``: what an encoding adds to the attention scores, as a heatmap per head.

Every position carries the same content vector c, so whatever varies across the (query, key)
grid comes from the encoding alone. The map is

    score(i, j) with the encoding  -  score(i, j) of the same content without positions,

both in logits (``q . k / sqrt(head_dim)`` plus any bias). "The same content without positions" is
what the encoding's ``embed`` makes of the content alone, ``embed(c, i) - embed(0, i)``: the
sinusoidal method multiplies the token embeddings by sqrt(dim) before adding its table (Vaswani et
al. 2017, §3.4), so its baseline is the score of sqrt(dim) c, not of c; a learned table leaves c as
it is. No encoding is special-cased: the rule follows from the hooks. For bias methods the map is
the bias itself (T5's near-fine, far-coarse buckets, ALiBi's slopes); for rotary methods it is the
change in the score of identical content vectors at two positions; Transformer-XL's global content
term u . k_j is included (the encoding adds it), a constant per head that softmax ignores.
Learned methods are shown at their initialisation (``seed``).

Every input is checked before anything is allocated or computed (:mod:`posenc.show.inputs`), and
every user mistake is a :class:`~posenc.errors.UsageError` naming the parameter and the allowed range.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..encodings import available, get_class
from ..encodings.base import PositionalEncoding
from ..encodings.protocol import Biases, Embeds, QueryTerms, Rotates, offers
from ..encodings.rope import RoPE
from ..errors import UsageError
from . import grid
from .layers import schedule_figure
from .scaling import scaling_figure, scaling_from_text

if TYPE_CHECKING:
    from matplotlib.figure import Figure
from .inputs import (
    CONTENT_SEED_KEY,
    MAX_LENGTH,
    MAX_PANELS,
    MAX_PIXELS,
    build_checked,
    check_heads,
    check_length,
    check_out,
    check_seed,
    check_sizes,
    get_class_checked,
    parse_options,
    write_png,
)


def score_map(encoding: PositionalEncoding, length: int, seed: int = 0, content: torch.Tensor | None = None) -> torch.Tensor:
    """(H, length, length) score change due to positions; NaN where a causal mask hides the key.

    Args:
        encoding: any encoding (hooks ``embed``, ``rotate``, ``bias``, ``query_terms``).
        length: positions on each axis.
        seed: draws the content vector when ``content`` is None.
        content: (H*D,) the content at every position (default: random, unit-variance features).
    Shape legend: H heads, T = length, D head dim.

    Raises:
        UsageError: ``content`` is not of shape (num_heads * head_dim,) (and the checks of
            :mod:`posenc.show.inputs` on the length and the encoding's table).
    """
    h, d = encoding.num_heads, encoding.head_dim
    length = check_length(length, h, encoding.max_positions, getattr(encoding, "name", "the encoding"))
    if content is None:
        # Not `seed` itself: show seeds the initial weights with it, and a learned table's first row
        # would then be the content vector (scaled), drawing a false stripe at key 0.
        gen = torch.Generator().manual_seed(check_seed(seed) ^ CONTENT_SEED_KEY)
        content = torch.randn(h * d, generator=gen)
        content = content / content.norm() * math.sqrt(h * d)  # unit-variance features
    elif tuple(content.shape) != (h * d,):
        raise UsageError(f"content must have shape ({h * d},) = (num_heads * head_dim,), got {tuple(content.shape)}")
    positions = torch.arange(length)
    scale = 1.0 / math.sqrt(d)
    x = content.expand(1, length, h * d)  # (1, T, dim): the same content at every position
    with torch.no_grad():
        plain = x  # the content as the model sees it, without positions
        if offers(encoding, Embeds):
            embedded = encoding.embed(x, positions)
            # What the embedding makes of the content alone (e.g. sqrt(dim) c for sinusoidal).
            plain = embedded - encoding.embed(torch.zeros_like(x), positions)
            x = embedded
        plain = plain.reshape(1, length, h, d).transpose(1, 2)  # (1, H, T, D)
        q = k = x.reshape(1, length, h, d).transpose(1, 2)  # (1, H, T, D)
        if offers(encoding, Rotates):
            q, k = encoding.rotate(q, k, positions, positions)
        scores = torch.matmul(q, k.transpose(-1, -2))[0].mul_(scale)  # (H, T, T)
        scores.sub_(torch.matmul(plain, plain.transpose(-1, -2))[0].mul_(scale))  # minus the score without positions
        if offers(encoding, Biases):
            scores.add_(encoding.bias(positions, positions))
        if offers(encoding, QueryTerms):
            scores.add_(encoding.query_terms(q, k, positions, positions)[0])
    if encoding.causal:
        scores.masked_fill_(positions[None, :] > positions[:, None], float("nan"))
    return scores


def block_mean(scores: torch.Tensor, factor: int) -> torch.Tensor:
    """(N, T, T) -> (N, ceil(T/factor), ceil(T/factor)): mean of the visible (non-NaN) cells of each
    factor x factor block, NaN where a block is all masked. What a screen pixel would show."""
    if factor == 1:
        return scores
    pad = (-scores.shape[-1]) % factor
    visible = F.pad((~scores.isnan()).float(), (0, pad, 0, pad))  # (N, T + pad, T + pad)
    total = F.avg_pool2d(F.pad(scores.nan_to_num(0.0), (0, pad, 0, pad)), factor)
    count = F.avg_pool2d(visible, factor)  # same divisor as `total`: it cancels
    return torch.where(count > 0, total / count.clamp(min=1e-12), float("nan"))


def heatmap(scores: torch.Tensor, title: str, note: str) -> Figure:
    """A figure of (N, T, T) ``scores``: one panel per head, one colour scale shared by all panels,
    symmetric around 0 (red: position raises the score, blue: lowers it); NaN (masked) is hatched."""
    from matplotlib import colormaps
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    heads, length = scores.shape[0], scores.shape[-1]
    factor = math.ceil(length / MAX_PIXELS)
    cells = block_mean(scores, factor)  # (N, T', T')
    drawn = cells.shape[-1] * factor - 0.5  # the last block may run past the last position: cropped below
    finite = scores[~scores.isnan()]
    vmax = float(finite.abs().max()) if finite.numel() else 0.0
    norm = Normalize(-vmax, vmax) if vmax > 0 else Normalize(-1.0, 1.0)  # all zero: white
    cmap = colormaps["RdBu_r"].with_extremes(bad=(0, 0, 0, 0))  # masked cells: transparent
    cols = min(heads, 4)
    rows = math.ceil(heads / cols)
    if factor > 1:
        note += f"\neach cell is the mean of a {factor} x {factor} block of (query, key) pairs"
    lines = 2 + note.count("\n")  # of the title
    fig = Figure(figsize=(max(2.9 * cols + 1.4, 6.0), 2.9 * rows + 0.2 * lines + 0.5), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, sharex=True, sharey=True)
    for idx, ax in enumerate(axes.flat):
        if idx >= heads:
            ax.axis("off")
            continue
        # Behind the image: hatching that shows through the transparent (masked) cells.
        ax.add_patch(Rectangle((-0.5, -0.5), length, length, facecolor="white", edgecolor="0.75", hatch="////", lw=0, zorder=0))
        im = ax.imshow(cells[idx].numpy(), cmap=cmap, norm=norm, interpolation="antialiased", extent=(-0.5, drawn, drawn, -0.5), zorder=1)
        ax.set_xlim(-0.5, length - 0.5)
        ax.set_ylim(length - 0.5, -0.5)
        values = scores[idx][~scores[idx].isnan()]  # the shared scale can wash out a weak head: say its range
        low, high = (0.0 if abs(v) <= 1e-5 * vmax else v for v in (float(values.min()), float(values.max())))  # float noise: 0
        ax.set_title(f"head {idx}: {low:.3g} to {high:.3g}", fontsize=9)
        if idx % cols == 0:
            ax.set_ylabel("query position i", fontsize=8)
        if idx + cols >= heads:
            ax.set_xlabel("key position j", fontsize=8)
            ax.xaxis.set_tick_params(labelbottom=True)
        ax.tick_params(labelsize=7)
    fig.colorbar(im, ax=axes, shrink=0.8, label="score change (logits)")
    fig.suptitle(f"{title}\n{note}", fontsize=9)
    return fig


def show(
    method: str, *, length: int = 64, num_heads: int = 8, head_dim: int = 64, heads: int | None = None,
    causal: bool = True, seed: int = 0, options: dict | None = None, out: Path | None = None,
) -> tuple[Path, torch.Tensor]:
    """Draw ``method``'s score map to ``out`` (default posenc-show-METHOD.png); returns (path, (N, T, T) drawn map)."""
    get_class_checked(method)
    num_heads, head_dim = check_sizes(num_heads, head_dim)
    shown = check_heads(heads, num_heads)
    check_length(length, num_heads)  # before the encoding exists; its own table is checked in score_map
    seed = check_seed(seed)
    out = check_out(Path(out) if out is not None else Path(f"posenc-show-{method}.png"))
    with torch.random.fork_rng(devices=[]):  # initial weights from `seed`, the caller's RNG untouched
        torch.manual_seed(seed)
        encoding = build_checked(method, num_heads, head_dim, causal, options or {})
    scores = score_map(encoding, length, seed)[:shown]
    mode = "causal" if causal else "bidirectional"
    title = f"{method} ({mode}): score change due to positions, {shown} of {num_heads} heads"
    note = (f"score with positions minus score of the same content without them (seed {seed})"
            "\nrows: query i, columns: key j")
    if causal:
        note += "; hatched: masked (key after query)"
    if not scores.nan_to_num().any():
        note += "\nzero everywhere: this encoding adds nothing to the scores"
    if any(True for _ in encoding.parameters()):
        note += f"\nlearned weights at initialisation (seed {seed}), not trained"
    write_png(heatmap(scores, title, note), out)
    return out, scores


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("method", nargs="?", default=None, help=f"one of: {', '.join(available())} (not with --schedule)")
    parser.add_argument("--length", type=int, default=64, help=f"positions on each axis (default 64, at most {MAX_LENGTH})")
    parser.add_argument("--num-heads", type=int, default=8, help="heads (default 8)")
    parser.add_argument("--head-dim", type=int, default=None, help="head dim (default 64; with --scaling, a config's own)")
    parser.add_argument("--heads", type=int, default=None, help=f"draw the first N heads (default min(8, num_heads), at most {MAX_PANELS})")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--causal", dest="causal", action="store_true", help="decoder: keys after the query are masked (default)")
    mode.add_argument("--bidirectional", dest="causal", action="store_false", help="encoder: every pair")
    parser.set_defaults(causal=True)
    parser.add_argument("--seed", type=int, default=0, help="seed for the content vector and initial weights")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="encoding option, e.g. --option num_buckets=16 (repeatable)")
    parser.add_argument("--out", type=Path, default=None,
                        help="PNG to write (default posenc-show-METHOD.png); an existing file is replaced only if posenc show wrote it")
    parser.add_argument("--schedule", default=None, metavar="TEXT",
                        help="draw a layer schedule instead of one method, e.g. '3x[rope:base=1e4 window=64] 1x[nope]' "
                             "(docs/schedules.md): which keys each layer sees")
    parser.add_argument("--depth", type=int, default=None, help="with --schedule: layers (the pattern repeats to it)")
    parser.add_argument("--scaling", default=None, metavar="JSON|FILE",
                        help="rope only: draw the wavelength of every pair, original vs this Hugging Face style scaling block "
                             "(JSON text, or a model's config.json), instead of the score map")


def show_scaling(method: str, scaling_text: str, head_dim: int | None, options: dict, out: Path | None) -> tuple[Path, str]:
    """``posenc show rope --scaling ...``: the frequency picture of a RoPE scaling. A whole config is
    read as ``rope_from_hf`` reads it (its head dim, base, partial rotary and the block transformers
    would read); returns (path, which block was drawn).

    Raises:
        UsageError: ``method`` is not rope; ``head_dim`` or ``base`` differs from what the scaling's
            config gives; or the scaling itself is invalid (naming its key).
    """

    get_class_checked(method)
    if not issubclass(get_class(method), RoPE):
        raise UsageError(f"scaling draws a RoPE scaling: method must be rope, got {method!r}")
    if head_dim is not None:
        _, head_dim = check_sizes(1, head_dim)
    out = check_out(Path(out) if out is not None else Path(f"posenc-show-{method}-scaling.png"))
    source = scaling_from_text(scaling_text, head_dim)
    if source.head_dim is not None and head_dim is not None and source.head_dim != head_dim:
        raise UsageError(f"head_dim: the config gives head_dim {source.head_dim}, not {head_dim}; leave out head_dim")
    head_dim = source.head_dim or head_dim or 64
    _, head_dim = check_sizes(1, head_dim)
    base = options.get("base")
    if base is not None and source.base is not None and float(base) != source.base:
        raise UsageError(f"base: the config gives rope_theta {source.base:g}, not {base:g}; leave out the base option")
    try:
        fig = scaling_figure(source.scaling, head_dim, base=base if base is not None else source.base,
                             rotary_dim=options.get("rotary_dim"))
    except UsageError:
        raise
    except ValueError as err:
        raise UsageError(f"scaling: {err}") from err
    write_png(fig, out)
    return out, source.note


def show_schedule(text: str, depth: int | None, length: int, causal: bool, out: Path | None) -> Path:
    """``posenc show --schedule TEXT``: which keys each layer of a layer schedule sees from the last query."""
    out = check_out(Path(out) if out is not None else Path("posenc-show-schedule.png"))
    write_png(schedule_figure(text, depth=depth, length=length, causal=causal), out)
    return out


def run(args: argparse.Namespace) -> int:
    """``posenc show``: the picture the arguments ask for, written as a PNG; the exit status.

    Raises:
        UsageError: neither a method nor ``--schedule`` is given, or both are (and every check of
            the inputs, naming the argument).
    """
    if args.schedule is not None:
        if args.method is not None:
            raise UsageError(f"method: --schedule draws a whole layer schedule; give no method (got {args.method!r})")
        out = show_schedule(args.schedule, args.depth, args.length, args.causal, args.out)
        print(f"schedule {args.schedule!r}: which keys each layer sees from the last of {args.length} positions -> {out}")
        return 0
    if args.method is None:
        raise UsageError(f"method: give one of {', '.join(available())}, or --schedule TEXT")
    options = parse_options(args.option, args.method)
    if args.scaling is None and grid.draws(args.method):  # a rotation over a 2-D patch grid
        return grid.run(args, options)
    if args.scaling is not None:
        out, note = show_scaling(args.method, args.scaling, args.head_dim, options, args.out)
        print(f"{args.method}: wavelength per pair, original vs scaled, from {note} -> {out}")
        return 0
    out, scores = show(args.method, length=args.length, num_heads=args.num_heads, head_dim=64 if args.head_dim is None else args.head_dim,
                       heads=args.heads, causal=args.causal, seed=args.seed, options=options, out=args.out)
    finite = scores[~scores.isnan()]
    print(f"{args.method}: {scores.shape[0]} of {args.num_heads} heads, length {args.length}, "
          f"score change in [{finite.min():.3f}, {finite.max():.3f}] -> {out}")
    return 0
