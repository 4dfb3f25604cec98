"""The denormal-flushing worker against the caller's thread: ``posenc.attend`` forward + backward.

    PYTHONPATH=src python benchmarks/flush_worker.py --out benchmarks/results/flush-worker [--rounds 5]

The bias methods' CPU kernel loops go to one worker thread that flushes denormals where the
caller's thread pays for them (``posenc.backends.parts.denormals.denormal_penalty`` at or above
``PENALTY``), and stay in the caller's thread elsewhere. This times both placements on this
machine, whatever the probe says: per method and length (B 1, H 8, D 32, float32, causal, q, k, v
token-major seen through a transpose as transformers hands them over), each method's step and
NoPE's, the fastest of ``--steps`` steps each. Each placement runs in a fresh process of its own,
the two alternating round after round: once the worker has run, its OpenMP team stays in the
process beside the caller's, so a process that switched between them would time both with two
teams. Ratios to NoPE are inside a process; worker against caller across the two processes of a
round, seconds apart. The probe's value is recorded too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import posenc
from posenc.backends.parts import denormals
from posenc.bench.machine import cpu_model

H, D = 8, 32


def child(args: argparse.Namespace) -> int:
    """One placement's times, printed as JSON: {"N method": [seconds per step kept]}."""
    torch.set_num_threads(args.threads)
    denormals.FLUSHED.needed = args.child == "worker"
    torch.manual_seed(0)
    out: dict[str, float] = {"penalty": denormals.denormal_penalty()}
    for n in args.lengths:
        q, k, v = (torch.randn(1, n, H, D).transpose(1, 2).requires_grad_() for _ in range(3))  # (1, H, n, D), token-major
        for method in [None, *args.methods]:
            enc = None if method is None else posenc.build(method, num_heads=H, head_dim=D)

            def step() -> float:
                start = time.perf_counter()
                posenc.attend(q, k, v, enc).sum().backward()
                return time.perf_counter() - start

            step()  # warm-up
            out[f"{n} {method or 'nope'}"] = min(step() for _ in range(args.steps))
    print(json.dumps(out))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--methods", nargs="+", default=["alibi", "kerple", "fire"])
    p.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", choices=["worker", "caller"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    base = [sys.executable, __file__, "--out", str(args.out), "--methods", *args.methods, "--lengths", *map(str, args.lengths),
            "--steps", str(args.steps), "--threads", str(args.threads)]
    runs: dict[str, list[dict[str, float]]] = {"worker": [], "caller": []}
    started = time.perf_counter()
    for r in range(args.rounds):
        for placement in (("worker", "caller") if r % 2 == 0 else ("caller", "worker")):
            done = subprocess.run([*base, "--child", placement], check=True, capture_output=True, text=True)
            runs[placement].append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"round {r + 1}/{args.rounds} done ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    penalty = statistics.median(run["penalty"] for run in runs["caller"])

    def ratio(a: list[float], b: list[float]) -> tuple[float, float, float]:
        rs = [x / y for x, y in zip(a, b)]
        return statistics.median(rs), min(rs), max(rs)

    rows = []
    for n in args.lengths:
        for m in args.methods:
            w, c = ([run[f"{n} {m}"] for run in runs[pl]] for pl in ("worker", "caller"))
            wn, cn = ([run[f"{n} nope"] for run in runs[pl]] for pl in ("worker", "caller"))
            rows.append({"length": n, "method": m, "worker_ms": 1e3 * statistics.median(w), "caller_ms": 1e3 * statistics.median(c),
                         "caller_over_worker": ratio(c, w), "worker_over_nope": ratio(w, wn), "caller_over_nope": ratio(c, cn),
                         "rounds": {"worker": w, "caller": c, "nope_in_worker_runs": wn, "nope_in_caller_runs": cn}})
    command = "PYTHONPATH=src python benchmarks/flush_worker.py " + " ".join(sys.argv[1:])
    fmt = "{:.2f}x ({:.2f}-{:.2f})".format
    lines = ["# Kernel loops in the denormal-flushing worker or in the caller's thread, posenc.attend forward + backward", "",
             f"CPU: {cpu_model()}; torch {torch.__version__}, {args.threads} thread(s); B 1, H {H}, D {D}, float32, causal, "
             f"token-major q, k, v; {args.rounds} rounds of one fresh process per placement (order alternated), the fastest of "
             f"{args.steps} steps each; median (min-max) over rounds.",
             f"denormal_penalty() here: {penalty:.2f} (the worker is used at {denormals.PENALTY:.0f} and above)",
             f"Command: `{command}`", "",
             "| N | method | worker (ms) | caller (ms) | caller / worker | worker / NoPE | caller / NoPE |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['length']} | {row['method']} | {row['worker_ms']:.1f} | {row['caller_ms']:.1f} | "
                     f"{fmt(*row['caller_over_worker'])} | {fmt(*row['worker_over_nope'])} | {fmt(*row['caller_over_nope'])} |")
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(text)
    (args.out / "results.json").write_text(json.dumps({"command": command, "cpu": cpu_model(), "torch": torch.__version__,
                                                       "threads": args.threads, "denormal_penalty": penalty, "rows": rows}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
