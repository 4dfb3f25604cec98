"""Packed rows against the same documents as batches: ``posenc.attend`` forward + backward.

    PYTHONPATH=src python benchmarks/packed.py --out benchmarks/results/packed [--rounds 5] [--threads 1]

Three layouts of 4096 tokens (the layouts Hugging Face's ``DataCollatorWithFlattening`` makes):

- ``64x64``: one row of 64 documents of 64 tokens, against a batch of 64 x 64;
- ``8x512``: one row of 8 documents of 512, against a batch of 8 x 512;
- ``mixed``: one row of documents of 16 to 512 tokens (drawn with a fixed seed), against the same
  documents as one batch per length (each length's documents stacked; the times summed).

Per method (H 8 heads, head dim 64, float32, causal): q, k, v (and the encoding's parameters) get
gradients; a step is ``attend(...)`` then ``.sum().backward()``. Each round times ``--steps``
consecutive steps of every (layout, method, variant), keeping the fastest (a step that met a page
fault storm is not the method's cost), in an order that rotates from round to round, after one
warm-up step each, so the steps a ratio compares ran seconds apart; the table gives the median of the per-round
ratios packed / batch and their min-max. Target (issue 33): at most 1.25x.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import posenc
from posenc.bench.machine import cpu_model

METHODS = ["nope", "rope", "alibi", "t5", "kerple", "fire", "shaw"]
LAYOUTS = ["64x64", "8x512", "mixed"]
H, D, N = 8, 64, 4096


def lengths_of(layout: str) -> list[int]:
    if layout == "64x64":
        return [64] * 64
    if layout == "8x512":
        return [512] * 8
    g = torch.Generator().manual_seed(0)
    out: list[int] = []
    while sum(out) < N:
        out.append(min(int(torch.randint(16, 513, (), generator=g)), N - sum(out)))
    return out


def made(b: int, n: int, memory: str) -> torch.Tensor:
    """A (b, H, n, D) input with gradients: head-major memory (``heads``), or token-major memory seen
    through a transpose (``tokens``), as a transformers attention layer hands q, k, v over."""
    if memory == "heads":
        return torch.randn(b, H, n, D, requires_grad=True)  # (b, H, n, D)
    return torch.randn(b, n, H, D).transpose(1, 2).requires_grad_()  # (b, H, n, D), token-major memory


class Case:
    """One (layout, method): the packed row and the batches of the same documents, with gradients."""

    def __init__(self, layout: str, method: str, memory: str = "heads") -> None:
        torch.manual_seed(0)
        self.encoding = None if method == "nope" else posenc.build(method, num_heads=H, head_dim=D)
        self.lengths = lengths_of(layout)
        ids = torch.cat([torch.full((n,), i) for i, n in enumerate(self.lengths)])[None]  # (1, N)
        self.row = [made(1, N, memory) for _ in range(3)]  # q, k, v (1, H, N, D)
        self.ids = ids
        groups: dict[int, int] = {}
        for n in self.lengths:
            groups[n] = groups.get(n, 0) + 1
        self.batches = [[made(b, n, memory) for _ in range(3)] for n, b in groups.items()]

    def packed(self) -> float:
        start = time.perf_counter()
        out = posenc.attend(*self.row, self.encoding, document_ids=self.ids)
        out.sum().backward()
        return time.perf_counter() - start

    def batch(self) -> float:
        start = time.perf_counter()
        for q, k, v in self.batches:
            posenc.attend(q, k, v, self.encoding).sum().backward()
        return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="steps timed per variant and round (the fastest kept)")
    p.add_argument("--methods", nargs="+", default=METHODS)
    p.add_argument("--layouts", nargs="+", default=LAYOUTS, choices=LAYOUTS)
    p.add_argument("--memory", default="heads", choices=["heads", "tokens"],
                   help="q, k, v in head-major memory, or token-major seen through a transpose (as transformers hands them)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cases = {(lay, m): Case(lay, m, args.memory) for lay in args.layouts for m in args.methods}
    jobs = [(lay, m, v) for (lay, m) in cases for v in ("packed", "batch")]
    for lay, m, v in jobs:  # warm-up
        getattr(cases[lay, m], v)()
    times: dict[tuple[str, str, str], list[float]] = {j: [] for j in jobs}
    started = time.perf_counter()
    for r in range(args.rounds):
        shift = r * max(1, len(jobs) // args.rounds)
        for lay, m, v in jobs[shift:] + jobs[:shift]:
            times[lay, m, v].append(min(getattr(cases[lay, m], v)() for _ in range(args.steps)))
        print(f"round {r + 1}/{args.rounds} done ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    cpu = cpu_model()
    rows = []
    for lay, m in cases:
        ratios = [a / b for a, b in zip(times[lay, m, "packed"], times[lay, m, "batch"])]
        rows.append({"layout": lay, "method": m, "packed_ms": 1e3 * statistics.median(times[lay, m, "packed"]),
                     "batch_ms": 1e3 * statistics.median(times[lay, m, "batch"]), "ratio": statistics.median(ratios),
                     "ratio_min": min(ratios), "ratio_max": max(ratios), "rounds": times[lay, m, "packed"]})
    command = "PYTHONPATH=src python benchmarks/packed.py " + " ".join(sys.argv[1:])
    lines = ["# Packed rows against the same documents as batches, posenc.attend forward + backward", "",
             f"CPU: {cpu}; torch {torch.__version__}, {args.threads} thread(s); H {H}, D {D}, float32, causal, "
             f"{args.memory.rstrip('s')}-major q, k, v; "
             f"{args.rounds} rounds (order rotated), the fastest of {args.steps} steps a round; ratios inside a round, "
             "median (min-max).",
             f"Command: `{command}`", "",
             "| layout | method | packed (ms) | batch (ms) | packed / batch |", "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['layout']} | {row['method']} | {row['packed_ms']:.1f} | {row['batch_ms']:.1f} | "
                     f"{row['ratio']:.2f}x ({row['ratio_min']:.2f}-{row['ratio_max']:.2f}) |")
    text = "\n".join(lines) + "\n"
    (out / "table.md").write_text(text)
    (out / "results.json").write_text(json.dumps({"command": command, "cpu": cpu, "torch": torch.__version__,
                                                  "threads": args.threads, "rows": rows}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
