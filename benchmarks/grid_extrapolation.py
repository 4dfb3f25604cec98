"""Image-size extrapolation of 2-D rotations: train a tiny ViT-style encoder on one grid size,
evaluate it on larger grids. Not a test; its output is committed beside it.

Task ("where is B from A"): an h x w grid of patch tokens, random filler tokens 3..9, one marker A
(token 1) and one marker B (token 2). The class is the direction from A to B along the axis of the
larger offset: right, left, down or up (|dx| != |dy|). Content alone cannot solve it, and the
answer depends only on the offset B - A, so an encoding whose scores depend on 2-D offsets
can carry what it learnt at one image size to any other. The encoder reads the answer out at A.

Training: grid 8 x 8 (offsets up to 7). Evaluation: grids 8, 12, 16, 24, in two columns each:
"near", offsets within the training range (|dx|, |dy| <= 7: the same offsets in a larger image,
which tests translation and size), and "any" (every offset the grid allows: longer offsets, never
seen in training).

Methods (each through its own ``rotate`` hook, on the positions it takes; the encoder is written
here so it can pass positions with an axis dimension):

- ``nope``: no positions (a floor: chance is 25%);
- ``rope``: 1-D RoPE on the raster index y * w + x, the way a sequence model reads an image: the
  raster offset of a patch pair changes with the width;
- ``axial_rope`` (base 100), ``rope_mixed`` (learned frequencies, base 10): (x, y) patch positions;
- ``mrope``: M-RoPE ids (0, y, x) of one image, Qwen2-VL's default sections.

Usage: ``PYTHONPATH=src python benchmarks/grid_extrapolation.py [--steps 800] [--seeds 3]``;
the table goes to stdout (benchmarks/results/grid-extrapolation/table.md holds a run).
Shape legend: B batch, T = h * w patches, H heads, D head dim.
"""

from __future__ import annotations

import argparse
import math
import platform
import time

import torch
import torch.nn.functional as F
from torch import nn

import posenc
from posenc.encodings.axial_rope import patch_positions
from posenc.encodings.mrope import vision_text_positions

VOCAB, DIM, HEADS, DEPTH, BATCH, TEST = 10, 32, 2, 2, 32, 500
TRAIN_GRID, EVAL_GRIDS, NEAR = 8, (8, 12, 16, 24), 7
METHODS = ("nope", "rope", "axial_rope", "rope_mixed", "mrope")


def positions_for(method: str, side: int) -> torch.Tensor | None:
    if method == "nope":
        return None
    if method == "rope":
        return torch.arange(side * side)  # raster index
    if method == "mrope":
        return vision_text_positions([(1, side, side)])  # (3, T)
    return patch_positions(side, side)  # (T, 2)


class Block(nn.Module):
    def __init__(self, encoding: nn.Module | None) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.encoding = encoding

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)  # (B, H, T, D) each
        if self.encoding is not None:
            q, k = self.encoding.rotate(q, k, positions, positions)
        a = F.scaled_dot_product_attention(q, k, v)  # bidirectional
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, DIM))
        return x + self.mlp(self.norm2(x))


class Encoder(nn.Module):
    def __init__(self, method: str) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        build = lambda: None if method == "nope" else posenc.build(method, num_heads=HEADS, head_dim=DIM // HEADS, causal=False)  # noqa: E731
        shared = build()
        per_layer = shared is not None and not shared.shares_across_layers
        self.blocks = nn.ModuleList(Block(build() if per_layer else shared) for _ in range(DEPTH))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, 4)

    def forward(self, tokens: torch.Tensor, at: torch.Tensor, positions) -> torch.Tensor:
        x = self.tok(tokens)  # (B, T, DIM)
        for block in self.blocks:
            x = block(x, positions)
        return self.head(self.norm(x[torch.arange(x.shape[0]), at]))  # read out at A: (B, 4)


def batch(side: int, size: int, near: bool, gen: torch.Generator):
    """tokens (B, T), index of A (B,), class (B,): 0 right, 1 left, 2 down, 3 up."""
    span = min(NEAR, side - 1) if near else side - 1
    got = []
    while sum(len(g[0]) for g in got) < size:  # draw in bulk, keep the valid pairs
        x0, y0 = torch.randint(0, side, (2, 4 * size), generator=gen)
        dx, dy = torch.randint(-span, span + 1, (2, 4 * size), generator=gen)
        x1, y1 = x0 + dx, y0 + dy
        keep = (dx.abs() != dy.abs()) & (x1 >= 0) & (x1 < side) & (y1 >= 0) & (y1 < side)
        got.append((x0[keep], y0[keep], x1[keep], y1[keep]))
    ax, ay, bx, by = (torch.cat([g[i] for g in got])[:size] for i in range(4))
    tokens = torch.randint(3, VOCAB, (size, side * side), generator=gen)
    a, b = ay * side + ax, by * side + bx
    rows = torch.arange(size)
    tokens[rows, a], tokens[rows, b] = 1, 2
    dx, dy = bx - ax, by - ay
    label = torch.where(dx.abs() > dy.abs(), torch.where(dx > 0, 0, 1), torch.where(dy > 0, 2, 3))
    return tokens, a, label


def train_and_eval(method: str, seed: int, steps: int) -> dict:
    torch.manual_seed(seed)
    model = Encoder(method)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.1)
    gen = torch.Generator().manual_seed(seed)
    pos = positions_for(method, TRAIN_GRID)
    for _ in range(steps):
        tokens, at, label = batch(TRAIN_GRID, BATCH, near=False, gen=gen)
        loss = F.cross_entropy(model(tokens, at, pos), label)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    out, test = {}, torch.Generator().manual_seed(10_000 + seed)
    with torch.no_grad():
        for side in EVAL_GRIDS:
            pos = positions_for(method, side)
            for near in (True, False):
                tokens, at, label = batch(side, TEST, near, test)
                pred = torch.cat([model(tokens[i:i + 100], at[i:i + 100], pos).argmax(-1) for i in range(0, TEST, 100)])
                out[(side, near)] = (pred == label).float().mean().item()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--methods", nargs="*", default=list(METHODS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.time()
    results = {m: [train_and_eval(m, s, args.steps) for s in range(args.seeds)] for m in args.methods}
    cols = [(side, near) for side in EVAL_GRIDS for near in (True, False)]
    print(f"# Grid extrapolation: trained on {TRAIN_GRID} x {TRAIN_GRID}, accuracy (%) at larger grids\n")
    print(f"{args.steps} steps of batch {BATCH}, {args.seeds} seeds (mean, min-max), {TEST} test images per cell; "
          f"encoder: {DEPTH} layers, dim {DIM}, {HEADS} heads; chance 25%. near: offsets |dx|, |dy| <= {NEAR} "
          f"(the training range); any: every offset of the grid.\n")
    print("| method | " + " | ".join(f"{s}x{s} {'near' if n else 'any'}" for s, n in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for m, runs in results.items():
        cells = []
        for c in cols:
            vals = [100 * r[c] for r in runs]
            cells.append(f"{sum(vals) / len(vals):.1f} ({min(vals):.0f}-{max(vals):.0f})")
        print(f"| {m} | " + " | ".join(cells) + " |")
    print(f"\nmachine: {platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread; "
          f"{math.ceil(time.time() - start)} s in all")


if __name__ == "__main__":
    main()
