"""What bounds ``posenc study --jobs 2``'s gain on a 2-core machine: per method, one study run at
one thread alone, at two threads alone, and two one-thread runs at once.

    PYTHONPATH=src python benchmarks/thread_scaling.py --out benchmarks/results/thread-scaling \
        [--methods shaw t5 rope nope] [--steps 150] [--rounds 1]

Each run is a fresh ``python -m posenc study --preset default --methods M --steps S --eval-lengths
64 --quiet`` into a temporary folder (its whole wall time: start-up, training, one evaluation).
Per method and round, in an order that rotates from round to round: ``alone1`` (``--threads 1``),
``alone2`` (``--threads 2``), ``pair1`` (two ``--threads 1`` runs started together; the later one's
time). With two workers each doing one run, ``--jobs 2`` over many runs takes about ``pair1 / 2``
per run against a serial two-thread study's ``alone2``, so ``pair1 / (2 alone2)`` is the floor of
study_jobs.py's ratio for that method: below 0.65 only where torch gains less than about 1.3x from
a second thread. Writes table.md and results.json into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from study_jobs import cpu

VARIANTS = ("alone1", "alone2", "pair1")


def command(method: str, steps: int, threads: int, out: Path) -> list[str]:
    return [sys.executable, "-m", "posenc", "study", "--preset", "default", "--methods", method, "--steps", str(steps),
            "--eval-lengths", "64", "--quiet", "--threads", str(threads), "--out", str(out)]


def timed(cmds: list[list[str]]) -> float:
    """Wall seconds until the last of ``cmds`` (started together) has finished."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL) for c in cmds]
    for p in procs:
        if p.wait():
            raise SystemExit(f"failed: {' '.join(p.args)}")  # type: ignore[arg-type]
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=["shaw", "t5", "rope", "nope"])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/thread-scaling"))
    args = p.parse_args()
    times: dict[str, dict[str, list[float]]] = {m: {v: [] for v in VARIANTS} for m in args.methods}
    for r in range(args.rounds):
        for method in args.methods:
            order = VARIANTS[r % 3:] + VARIANTS[: r % 3]
            with tempfile.TemporaryDirectory(prefix="posenc-threads-") as tmp:
                for i, variant in enumerate(order):
                    where = Path(tmp) / f"{variant}{i}"
                    cmds = ([command(method, args.steps, 1, where / "a"), command(method, args.steps, 1, where / "b")]
                            if variant == "pair1" else [command(method, args.steps, int(variant[-1]), where)])
                    times[method][variant].append(timed(cmds))
            print(f"round {r + 1}: {method} " + ", ".join(f"{v} {times[method][v][-1]:.1f} s" for v in VARIANTS),
                  file=sys.stderr, flush=True)
    rows = []
    for method in args.methods:
        t = {v: statistics.median(times[method][v]) for v in VARIANTS}
        rows.append({"method": method, **{f"{v}_s": t[v] for v in VARIANTS}, "speedup_2_threads": t["alone1"] / t["alone2"],
                     "pair_slowdown": t["pair1"] / t["alone1"], "floor": t["pair1"] / (2 * t["alone2"]), "rounds": times[method]})
    lines = ["# Thread scaling: what bounds --jobs 2 against a serial two-thread study", "",
             f"CPU: {cpu()}, {os.cpu_count()} cores; {args.rounds} round(s), medians; each run: study --preset default "
             f"--methods M --steps {args.steps} --eval-lengths 64 (whole wall time)", "",
             "| method | alone, 1 thread (s) | alone, 2 threads (s) | two at once, 1 thread (s) | 2-thread speed-up | "
             "slow-down of a pair | floor of jobs2 / serial2 |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['method']} | {row['alone1_s']:.1f} | {row['alone2_s']:.1f} | {row['pair1_s']:.1f} | "
                     f"{row['speedup_2_threads']:.2f}x | {row['pair_slowdown']:.2f}x | {row['floor']:.2f}x |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    (args.out / "results.json").write_text(json.dumps({"command": sys.argv, "options": {k: str(v) for k, v in vars(args).items()},
                                                       "cpu": cpu(), "cores": os.cpu_count(), "rows": rows}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
