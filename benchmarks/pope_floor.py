"""The floor under PoPE's training cost on this machine: attention whose queries and keys have 2 D
features against attention with D.

Not a test: a benchmark. PoPE (Gopalakrishnan et al. 2025, arXiv 2509.10534, §3) gives each of the D
features of a head its own frequency, so q and k leave the rotation with 2 D real features (a
magnitude times cos and sin of a position-only phase) while the values keep D: every score is a dot
product of 2 D features. Whatever an implementation does around the kernel, the kernel's own work
at 2 D is a floor under its cost. Four jobs, training (forward and backward) of one causal
attention at ``--length`` tokens (B = 1, H = 8, D = 64, float32), in alternated rounds (the order
rotated every round; each job's ratio to NoPE taken inside its round; median and min-max):

- ``nope``: ``posenc.attend`` with no encoding (the CPU flash kernel at D);
- ``sdpa 2D``: ``scaled_dot_product_attention`` on q and k of 2 D features with the values padded
  to 2 D (the fastest form of a 2 D kernel here; the output's first D features kept);
- ``sdpa 2D/D``: the same with values of D, unpadded (the kernel's form for unequal sizes);
- ``pope``: ``posenc.attend`` with ``posenc.build("pope")``.

    .venv/bin/python benchmarks/pope_floor.py --out benchmarks/results/pope-floor

Writes ``results.json`` and ``table.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from alternated import alternated  # (benchmarks/, this script's folder)

import posenc
from posenc.bench.machine import cpu_model
from posenc.files import write_json, write_text

B, H, D = 1, 8, 64


def jobs(n: int) -> dict[str, Callable[[], None]]:
    """Each job: one training step (forward and backward) of one attention call at n tokens."""
    torch.manual_seed(0)

    def leaf(d: int) -> torch.Tensor:
        return torch.randn(B, H, n, d, requires_grad=True)  # (B, H, N, d)

    q, k, v = leaf(D), leaf(D), leaf(D)
    q2, k2 = leaf(2 * D), leaf(2 * D)
    pope = posenc.build("pope", num_heads=H, head_dim=D)

    def encoded(enc: object) -> Callable[[], None]:
        return lambda: posenc.attend(q, k, v, enc).sum().backward()  # type: ignore[arg-type]

    def padded() -> None:
        out = F.scaled_dot_product_attention(q2, k2, F.pad(v, (0, D)), is_causal=True, scale=D ** -0.5)
        out[..., :D].sum().backward()

    def unequal() -> None:
        F.scaled_dot_product_attention(q2, k2, v, is_causal=True, scale=D ** -0.5).sum().backward()

    return {"nope": encoded(None), "sdpa 2D": padded, "sdpa 2D/D": unequal, "pope": encoded(pope)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for results.json and table.md")
    p.add_argument("--length", type=int, default=4096, help="tokens (default 4,096)")
    p.add_argument("--rounds", type=int, default=7, help="alternated rounds (default 7)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    run = jobs(args.length)
    rows = alternated(run, args.rounds)
    machine = f"{cpu_model()}, {args.threads} threads, torch {torch.__version__}"
    out = Path(args.out)
    write_json(out / "results.json", {"length": args.length, "rounds": args.rounds, "machine": machine, "rows": rows})
    lines = [f"Training (forward and backward) of one causal attention call at {args.length:,} tokens, B = 1, H = 8, "
             f"D = 64, float32; {args.rounds} alternated rounds; {machine}.", "",
             "| job | seconds | vs NoPE |", "|---|---:|---:|"]
    lines += [f"| {m} | {v['seconds']:.3f} | {v['ratio']:.2f}x ({v['ratio_min']:.2f}-{v['ratio_max']:.2f}) |" for m, v in rows.items()]
    write_text(out / "table.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
