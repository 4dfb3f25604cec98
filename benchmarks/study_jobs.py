"""Wall time of a whole study run serially at two threads against ``--jobs 2`` at one thread a run
(the target: at most 0.65x on 2 cores), and that ``--jobs 2``'s numbers equal a serial study's
at one thread.

In rounds: each round runs every variant once, each a fresh ``python -m posenc study`` into a
temporary folder (removed after), the order rotated from round to round; the ratio of a round is
its ``jobs2`` time over its ``serial2`` time, reported as the median and min-max over rounds.

- ``serial2``: ``--threads 2`` (today's serial study on 2 cores: torch's default there);
- ``jobs2``: ``--jobs 2 --threads 1``;
- ``serial1``: ``--threads 1``, in the first round only (``--check-every`` rounds), for the numbers:
  every loss, perplexity and interval of ``jobs2`` must equal it. ``--no-serial1`` leaves it out;
  ``--numbers-from DIR`` then compares ``jobs2``'s numbers with the first seed of a study kept there.

Usage: ``python benchmarks/study_jobs.py [--preset default] [--rounds 3] [--methods ...]
[--steps N] [--out benchmarks/results/study-jobs]``. Writes table.md and results.json into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from posenc.bench.machine import cpu_model

VARIANTS = {"serial2": ["--threads", "2"], "jobs2": ["--jobs", "2", "--threads", "1"], "serial1": ["--threads", "1"]}
TARGET = 0.65


def numbers(out: Path) -> dict:
    """Every number of a study but its timings."""
    results = json.loads((out / "results.json").read_text())
    got = {}
    for name, entry in results["methods"].items():
        got[name] = [(r["status"], r["train"].get("losses"), [(e["length"], e.get("loss"), e.get("perplexity"),
                      e.get("ppl_low"), e.get("ppl_high")) for e in r["eval"]]) for r in [entry, *entry.get("seeds", [])]]
    return got


def _seconds(rounds: list[dict], name: str) -> list[str]:
    return [f"{r['times_s'][name]:.1f}" for r in rounds if name in r["times_s"]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="default")
    p.add_argument("--methods", nargs="+", default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--check-every", type=int, default=0, help="run serial1 every K rounds (0: the first round only)")
    p.add_argument("--no-serial1", action="store_true", help="never run serial1 (its numbers: --numbers-from)")
    p.add_argument("--numbers-from", metavar="DIR", help="a study folder whose first seed's numbers jobs2's must equal "
                                                          "(with --no-serial1)")
    p.add_argument("--out", default="benchmarks/results/study-jobs")
    args = p.parse_args()
    common = ["--preset", args.preset, "--quiet"] + (["--methods", *args.methods] if args.methods else []) + (
        ["--steps", str(args.steps)] if args.steps else [])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    given = None if not args.numbers_from else {name: runs[:1] for name, runs in numbers(Path(args.numbers_from)).items()}
    rounds = []
    for r in range(args.rounds):
        checked = not args.no_serial1 and (r == 0 or (args.check_every and r % args.check_every == 0))
        names = ["serial2", "jobs2"] + (["serial1"] if checked else [])
        order = names[r % len(names):] + names[: r % len(names)]
        times, nums = {}, {}
        with tempfile.TemporaryDirectory(prefix="posenc-study-jobs-") as tmp:
            for name in order:
                where = Path(tmp) / name
                cmd = [sys.executable, "-m", "posenc", "study", *common, *VARIANTS[name], "--out", str(where)]
                t0 = time.perf_counter()
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ})
                times[name] = time.perf_counter() - t0
                nums[name] = numbers(where)
                print(f"round {r + 1}: {name} {times[name]:.1f} s", file=sys.stderr, flush=True)
                shutil.rmtree(where)
        same = nums["jobs2"] == nums["serial1"] if "serial1" in nums else None
        record = {"times_s": times, "ratio": times["jobs2"] / times["serial2"], "jobs2_equals_serial1": same}
        if given is not None:
            record["jobs2_equals_numbers_from"] = given == {name: runs[:1] for name, runs in nums["jobs2"].items()}
        rounds.append(record)
    ratios = [r["ratio"] for r in rounds]
    ran = [n for n in VARIANTS if any(n in r["times_s"] for r in rounds)]
    med = {n: statistics.median(r["times_s"][n] for r in rounds if n in r["times_s"]) for n in ran}
    checks = [r["jobs2_equals_serial1"] for r in rounds if r["jobs2_equals_serial1"] is not None]
    lines = [
        f"# posenc study: --jobs 2 at 1 thread vs serial at 2 threads ({args.preset} preset)", "",
        f"CPU: {cpu_model()}, {os.cpu_count()} cores; python {platform.python_version()}; {len(rounds)} rounds; "
        f"options: {' '.join(common)}", "",
        "| variant | median wall (s) | rounds (s) |", "|---|---|---|",
        *[f"| {n} ({' '.join(VARIANTS[n])}) | {med[n]:.1f} | {', '.join(_seconds(rounds, n))} |" for n in ran],
        "", f"jobs2 / serial2: {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) over rounds; "
        f"target <= {TARGET}x: {'met' if statistics.median(ratios) <= TARGET else 'NOT met'}",
        f"jobs2's numbers equal serial1's: {'yes' if checks and all(checks) else 'NO' if checks else 'not run'} ({len(checks)} checked)",
    ]
    if args.numbers_from:
        ok = all(r["jobs2_equals_numbers_from"] for r in rounds)
        lines.append(f"jobs2's numbers equal the first seed of {args.numbers_from}: {'yes' if ok else 'NO'} ({len(rounds)} checked)")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps({"command": sys.argv, "options": vars(args), "cpu": cpu_model(),
                                                  "cores": os.cpu_count(), "rounds": rounds}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
