"""The floor under a bias method's training cost on this machine: causal attention that carries an
additive float bias on its scores, against attention with none.

Not a test: a benchmark. A bias-style method (the dynamic position bias, the Inkling bias, selective
attention) adds a float to every score q_i . k_j / sqrt(D) of the causal triangle, so whatever an
implementation does to make that bias, the kernel must take it: a dense mask, which a fused kernel
reads for every pair and which costs it the causal skip (the causal triangle becomes -inf entries
of the mask), or per block of queries, a mask over the keys that block sees. Jobs, training (forward
and backward) of one causal attention at each ``--lengths`` (B = 1, H = 8, D = 64, float32), in
alternated rounds (the order rotated every round; each job's ratio to NoPE taken inside its round;
median and min-max over rounds):

- ``nope``: ``scaled_dot_product_attention(is_causal=True)``, no bias;
- ``sdpa bias 1``: SDPA with a precomputed dense (1, 1, N, N) float bias, -inf above the diagonal;
- ``sdpa bias H``: the same with one bias per head, (1, H, N, N);
- ``blocked bias C``: per block of C queries, the CPU flash kernel over the keys the block sees
  with the block's (1, H, C, keys) slice of a precomputed bias as its mask, and its own backward
  (the bias fixed: no gradient for it), for each ``--blocks`` C;
- ``dpb``, ``inkling``, ``selective``: ``posenc.attend`` with ``posenc.build(...)`` (the Inkling
  curves, (B, H, N, R) from the layer input, precomputed outside the timed step; the dpb MLP and
  the Inkling curves receive their gradient).

    .venv/bin/python benchmarks/bias_floor.py --out benchmarks/results/bias-floor

Writes ``results.json`` and ``table.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from alternated import alternated  # (benchmarks/, this script's folder)

import posenc
from posenc.backends.parts.regions import kernel_backward, kernel_forward
from posenc.bench.machine import cpu_model
from posenc.files import write_json, write_text

B, H, D = 1, 8, 64
METHODS = ("dpb", "inkling", "selective")


class _BlockedBias(torch.autograd.Function):
    """Causal attention with a fixed dense bias (1, H, N, N), per block of ``block`` queries: the
    kernel over keys 0..a1-1 with the block's slice of the bias (the staircase -inf in it)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, block: int) -> torch.Tensor:
        n = q.shape[-2]
        out, lse = torch.empty_like(q), q.new_empty(q.shape[:3])  # (B, H, N, D), (B, H, N)
        for a0 in range(0, n, block):
            a1 = min(a0 + block, n)
            out[:, :, a0:a1], lse[:, :, a0:a1] = kernel_forward(q[:, :, a0:a1], k[:, :, :a1], v[:, :, :a1], False, D ** -0.5,
                                                                bias[:, :, a0:a1, :a1])
        ctx.block = block
        ctx.save_for_backward(q, k, v, bias, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, bias, out, lse = ctx.saved_tensors
        n, dout = q.shape[-2], dout.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for a0 in range(0, n, ctx.block):
            a1 = min(a0 + ctx.block, n)
            gq, gk, gv = kernel_backward(dout[:, :, a0:a1], q[:, :, a0:a1], k[:, :, :a1], v[:, :, :a1], out[:, :, a0:a1],
                                         lse[:, :, a0:a1].contiguous(), False, D ** -0.5, bias[:, :, a0:a1, :a1])
            dq[:, :, a0:a1] = gq
            dk[:, :, :a1] += gk
            dv[:, :, :a1] += gv
        return dq, dk, dv, None, None


def jobs(n: int, blocks: list[int], methods: list[str]) -> dict[str, Callable[[], None]]:
    """Each job: one training step (forward and backward) of one attention call at n tokens."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, requires_grad=True) for _ in range(3))  # (B, H, N, D)
    causal = torch.ones(n, n, dtype=torch.bool).tril()  # (N, N)
    dense = torch.randn(1, H, n, n).masked_fill(~causal, float("-inf"))  # (1, H, N, N): a bias per head
    one = dense[:, :1].contiguous()  # (1, 1, N, N)

    def sdpa(bias: torch.Tensor | None) -> Callable[[], None]:
        if bias is None:
            return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias).sum().backward()

    def blocked(c: int) -> Callable[[], None]:
        return lambda: _BlockedBias.apply(q, k, v, dense, c).sum().backward()  # type: ignore[no-untyped-call]

    def method(name: str) -> Callable[[], None]:
        enc = posenc.build(name, num_heads=H, head_dim=D)
        if name != "inkling":
            return lambda: posenc.attend(q, k, v, enc).sum().backward()
        x = torch.randn(B, n, H * D)  # (B, N, H D): the layer input the curves read

        def step() -> None:
            curves = enc.query_curves(x, torch.arange(n))  # type: ignore[operator]  # (B, H, N, R)
            posenc.attend(q, k, v, enc, query_curves=curves).sum().backward()
        return step

    run: dict[str, Callable[[], None]] = {"nope": sdpa(None), "sdpa bias 1": sdpa(one), "sdpa bias H": sdpa(dense)}
    run.update({f"blocked bias {c}": blocked(c) for c in blocks})
    run.update({m: method(m) for m in methods})
    return run


def measure(n: int, blocks: list[int], methods: list[str], rounds: int) -> dict[str, dict[str, float]]:
    """Alternated rounds at n tokens: each job's median seconds and ratio to NoPE (median, min, max)."""
    return alternated(jobs(n, blocks, methods), rounds, label=f"N={n} ")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for results.json and table.md")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096], help="tokens (default 4,096)")
    p.add_argument("--blocks", type=int, nargs="+", default=[256, 1024], help="query rows per block of the blocked jobs (default 256 1024)")
    p.add_argument("--methods", nargs="*", default=list(METHODS), help=f"posenc methods timed beside the floor (default {' '.join(METHODS)})")
    p.add_argument("--rounds", type=int, default=7, help="alternated rounds (default 7)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = p.parse_args()
    if any(c < 1 for c in args.blocks) or any(n < 1 for n in args.lengths) or args.rounds < 1:
        p.error("--lengths, --blocks and --rounds take positive integers")
    torch.set_num_threads(args.threads)
    results = {n: measure(n, args.blocks, args.methods, args.rounds) for n in args.lengths}
    machine = f"{cpu_model()}, {args.threads} threads, torch {torch.__version__}"
    out = Path(args.out)
    write_json(out / "results.json", {"lengths": args.lengths, "rounds": args.rounds, "machine": machine,
                                      "rows": {str(n): rows for n, rows in results.items()}})
    lines = [f"Training (forward and backward) of one causal attention call, B = 1, H = 8, D = 64, float32; "
             f"{args.rounds} alternated rounds; {machine}.", "",
             "| job | " + " | ".join(f"N = {n:,}: seconds | vs NoPE" for n in args.lengths) + " |",
             "|---|" + "---:|---:|" * len(args.lengths)]
    for m in results[args.lengths[0]]:
        cells = [f"{results[n][m]['seconds']:.3f} | {results[n][m]['ratio']:.2f}x ({results[n][m]['ratio_min']:.2f}-"
                 f"{results[n][m]['ratio_max']:.2f})" for n in args.lengths]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    write_text(out / "table.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
