"""``posenc show METHOD``: what an encoding adds to the attention scores, as a heatmap per head.

Every position carries the same content vector c, so whatever varies across the (query, key)
grid comes from the encoding alone: ``score(i, j) - score_without_positions``. For bias methods
that is the bias itself (T5's near-fine, far-coarse buckets, ALiBi's slopes); for absolute and
rotary methods it is the change in the score between identical content vectors at two positions.
Learned methods are shown at their initialisation (``--seed``) unless trained weights are loaded.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from .encodings import available, build
from .encodings.base import check_positive, has_hook


def score_map(encoding: torch.nn.Module, length: int, seed: int = 0) -> torch.Tensor:
    """(H, length, length) score change due to positions; NaN where a causal mask hides the key."""
    h, d = encoding.num_heads, encoding.head_dim
    gen = torch.Generator().manual_seed(seed)
    content = torch.randn(h * d, generator=gen)
    content = content / content.norm() * math.sqrt(h * d)  # unit-variance features
    positions = torch.arange(length)
    x = content.expand(1, length, h * d)  # (1, T, dim): the same content at every position
    with torch.no_grad():
        if has_hook(encoding, "embed"):
            x = encoding.embed(x, positions)
        q = k = x.view(1, length, h, d).transpose(1, 2)  # (1, H, T, D)
        if has_hook(encoding, "rotate"):
            q, k = encoding.rotate(q, k, positions, positions)
        scale = 1.0 / math.sqrt(d)
        scores = torch.matmul(q, k.transpose(-1, -2))[0] * scale  # (H, T, T)
        base = (content.view(h, d) ** 2).sum(-1)[:, None, None] * scale  # (H, 1, 1) score with no positions
        scores = scores - base
        if has_hook(encoding, "bias"):
            scores = scores + encoding.bias(positions, positions)
        if has_hook(encoding, "query_terms"):
            scores = scores + encoding.query_terms(q, k, positions, positions)[0]
    if encoding.causal:
        scores = scores.masked_fill(positions[None, :] > positions[:, None], float("nan"))
    return scores


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("method", help=f"one of: {', '.join(available())}")
    parser.add_argument("--length", type=int, default=64, help="positions on each axis (default 64)")
    parser.add_argument("--num-heads", type=int, default=8, help="heads (default 8)")
    parser.add_argument("--head-dim", type=int, default=64, help="head dim (default 64)")
    parser.add_argument("--heads", type=int, default=None, help="show only the first N heads (default all, at most 8)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--causal", dest="causal", action="store_true", help="decoder: keys after the query are masked (default)")
    mode.add_argument("--bidirectional", dest="causal", action="store_false", help="encoder: every pair")
    parser.set_defaults(causal=True)
    parser.add_argument("--seed", type=int, default=0, help="seed for the content vector and initial weights")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="encoding option, e.g. --option num_buckets=16 (repeatable)")
    parser.add_argument("--out", type=Path, default=None, help="PNG to write (default posenc-show-METHOD.png)")


def parse_options(pairs: list[str]) -> dict:
    options = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--option must be KEY=VALUE, got {pair!r}")
        key, value = pair.split("=", 1)
        for cast in (int, float):
            try:
                options[key] = cast(value)
                break
            except ValueError:
                continue
        else:
            options[key] = value
    return options


def plot_score_map(scores: torch.Tensor, title: str, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = scores.shape[0]
    cols = min(heads, 4)
    rows = math.ceil(heads / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows + 0.6), squeeze=False)
    for idx, ax in enumerate(axes.flat):
        if idx >= heads:
            ax.axis("off")
            continue
        im = ax.imshow(scores[idx].numpy(), cmap="viridis", interpolation="nearest")
        ax.set_title(f"head {idx}", fontsize=9)
        ax.set_xlabel("key position j", fontsize=8)
        ax.set_ylabel("query position i", fontsize=8)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def run(args: argparse.Namespace) -> int:
    check_positive("--length", args.length)
    torch.manual_seed(args.seed)
    encoding = build(args.method, num_heads=args.num_heads, head_dim=args.head_dim, causal=args.causal, **parse_options(args.option))
    if encoding.max_positions is not None and args.length > encoding.max_positions:
        raise ValueError(f"--length {args.length} is past {args.method}'s table (max_positions={encoding.max_positions})")
    scores = score_map(encoding, args.length, args.seed)
    shown = min(args.heads or 8, scores.shape[0])
    out = args.out or Path(f"posenc-show-{args.method}.png")
    mode = "causal" if args.causal else "bidirectional"
    title = f"{args.method} ({mode}): score added by position, query i x key j"
    if any(True for _ in encoding.parameters()):
        title += " [learned weights at init]"
    plot_score_map(scores[:shown], title, out)
    finite = scores[~scores.isnan()]
    print(f"{args.method}: {shown} of {scores.shape[0]} heads, length {args.length}, "
          f"score change in [{finite.min():.3f}, {finite.max():.3f}] -> {out}")
    return 0
