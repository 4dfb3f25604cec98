"""Benchmarks of layer schedules (issue 19's performance checks): windows, windowed decoding, 3:1.

Three tables, each measured in rounds: every job of a table runs once per round in a fresh process,
the order rotated from round to round, and every ratio is taken inside one round before the median
and min-max over rounds are reported.

1. ``window``: ``posenc.attend`` with a sliding window W=256 at N=4096, forward + backward (B=1,
   H=8, D=64), against full causal attention of the same method. Target: at most 0.35x.
2. ``decode``: one windowed ``posenc.Attention`` layer (dim 512, 8 heads, W=256) decoding with its
   windowed KV cache (``LayerCache(window=W)``, filled with random keys and values): time per
   token after a cache of 8192 against after 512, inference. Target: within 1.1x.
3. ``schedule``: an LM (dim 512, depth 4, 8 heads) of 3 windowed layers (W=256) : 1 full layer,
   forward + backward at N=4096, against the weighted mean of the same LM with every layer
   windowed and every layer full (3/4 x local + 1/4 x global). Target: at most 1.0x.

``--quick``: tiny sizes and one round, to check that the script runs (its figures mean nothing);
``--in-process`` runs the jobs without a fresh interpreter each (the test does both).
``--alternate K``: each table's variants of one method (full and windowed steps; the two caches; the
local, global and 3:1 models) in one fresh process per method and round, alternated K times (in
turn, the order reversed every other time), the round's time of each the median of its K; on a
machine whose speed drifts between processes this keeps the sides of each ratio under the same
conditions (the peak memory is then the process's, over all of them).

Usage: ``python benchmarks/schedule.py [--rounds 3] [--tables window decode schedule]
[--methods rope alibi] [--alternate K] [--quick] [--out benchmarks/results/schedule]``. Writes table.md and
results.json into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

WORKER = "--worker"
TABLES = ("window", "decode", "schedule")
METHODS = ("rope", "alibi")
TARGETS = {"window": 0.35, "decode": 1.1, "schedule": 1.0}
# Sizes of the checks, and the --quick ones (seconds in all).
FULL = dict(n=4096, window=256, caches=(512, 8192), steps=50, dim=512, heads=8, lm_n=4096)
QUICK = dict(n=256, window=32, caches=(64, 512), steps=4, dim=64, heads=4, lm_n=128)


def schedule_text(method: str, variant: str, window: int) -> str:
    """The LM of a ``schedule`` job: every layer windowed, every layer full, or 3 : 1."""
    return {"local": f"[{method} window={window}]", "global": f"[{method}]",
            "mixed": f"3x[{method} window={window}] 1x[{method}]"}[variant]


def job_list(table: str, methods: list[str], sizes: dict, alternate: int = 0) -> list[dict]:
    """A job per method and variant of the table, or with ``alternate`` one per method (all its variants)."""
    if table not in TABLES:
        raise SystemExit(f"unknown table {table!r}; choose from {', '.join(TABLES)}")
    if alternate:
        return [{"table": table, "method": m, "variant": "alternate", "alternate": alternate, **sizes} for m in methods]
    return [{"table": table, "method": m, "variant": v, **sizes} for m in methods for v in variants({"table": table, **sizes})]


# ------------------------------------------------------------------------------------------------
# The worker: one job, timed, in its own process


VARIANTS = {"window": ("full", "window"), "schedule": ("local", "global", "mixed")}  # decode: "cache N" per cache size
REPS = {"window": 2, "decode": 3, "schedule": 2}  # timed steps after one warm-up, per job


def variants(job: dict) -> tuple[str, ...]:
    if job["table"] == "decode":
        return tuple(f"cache {c}" for c in job["caches"])
    return VARIANTS[job["table"]]


def steps(job: dict, names: tuple[str, ...]) -> dict:
    """{variant: (step, extra)} for the job's table: ``step()`` runs one timed unit, ``extra(record)``
    the variant's own fields for its result record."""
    import torch

    import posenc
    from posenc.model.cache import LayerCache

    torch.manual_seed(0)
    table, method = job["table"], job["method"]
    h, dim, w = job["heads"], job["dim"], job["window"]
    d = dim // h
    made = {}
    if table == "window":
        n = job["n"]
        enc = posenc.build(method, num_heads=h, head_dim=d)
        q = torch.randn(1, h, n, d, requires_grad=True)  # (B, H, N, D)
        k = torch.randn(1, h, n, d, requires_grad=True)
        v = torch.randn(1, h, n, d, requires_grad=True)
        for name in names:
            def step(window=w if name == "window" else None):
                posenc.attend(q, k, v, enc, window=window).sum().backward()

            made[name] = (step, lambda record: {})
    elif table == "decode":
        enc = posenc.build(method, num_heads=h, head_dim=d)
        attn = posenc.Attention(dim, h, enc, window=w).eval()
        x = torch.randn(1, 1, dim)  # (B, 1, dim) the new token's input
        count = job["steps"]
        for name in names:
            cache = LayerCache(window=w)
            with torch.inference_mode():
                keys = torch.randn(1, h, int(name.split()[1]), d)  # (B, H, N, D): what a step costs does not depend on them
                cache.append(keys, torch.randn_like(keys))

            def step(cache=cache):
                with torch.inference_mode():
                    for _ in range(count):
                        attn(x, torch.tensor([cache.length]), cache)

            made[name] = (step, lambda record, cache=cache, size=int(name.split()[1]): {
                "cache": size, "per_token_s": record["seconds"] / count, "kept_keys": cache.held, "cache_capacity": cache.capacity})
    elif table == "schedule":
        tokens = torch.randint(0, 256, (1, job["lm_n"]))  # (B, N)
        for name in names:
            model = posenc.LM(posenc.LMConfig(dim=dim, depth=4, num_heads=h, schedule=schedule_text(method, name, w)))

            def step(model=model):
                logits = model(tokens)  # (B, N, vocab)
                torch.nn.functional.cross_entropy(logits.view(-1, 256), tokens.view(-1)).backward()
                model.zero_grad(set_to_none=True)

            made[name] = (step, lambda record, model=model: {"windows": [b.attn.window for b in model.blocks]})
    else:
        raise SystemExit(f"unknown table {table!r}")
    return made


def work(job: dict) -> dict:
    """One job: its variant's step timed (the fastest of REPS after one warm-up), or with
    ``"alternate"`` every variant of the table alternated in this process (:func:`alternated`)."""
    from posenc.bench.worker import timed

    if job["variant"] == "alternate":
        return alternated(steps(job, variants(job)), job["alternate"])
    step, extra = steps(job, (job["variant"],))[job["variant"]]
    record = timed(step, REPS[job["table"]])
    return {**record, **extra(record)}


def alternated(made: dict, times: int) -> dict:
    """The variants' steps alternated ``times`` times in this process (in turn, the order reversed
    every other time), after one warm-up each: {variant: record}, each record's seconds the median
    of its runs (and its variant's own fields), the peak memory the process's over all of them."""
    from posenc.bench.worker import maxrss_mb, reset_peak_rss

    for step, _ in made.values():
        step()
    base = reset_peak_rss()
    base = maxrss_mb() if base is None else base
    runs: dict[str, list[float]] = {name: [] for name in made}
    for n in range(times):
        for name in (list(made) if n % 2 == 0 else list(made)[::-1]):
            t0 = time.perf_counter()
            made[name][0]()
            runs[name].append(time.perf_counter() - t0)
    peak = maxrss_mb() - base
    out = {}
    for name, ts in runs.items():
        record = {"variant": name, "seconds": statistics.median(ts), "runs_s": ts, "peak_over_baseline_mb": peak}
        out[name] = {**record, **made[name][1](record)}
    return out


# ------------------------------------------------------------------------------------------------
# The parent: rounds, ratios, tables



def key(job: dict) -> str:
    return json.dumps(job, sort_keys=True)


def measure(jobs: list[dict], rounds: int, threads: int | None, in_process: bool = False) -> list[list[dict]]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    results = []
    for r in range(rounds):
        order = jobs[r % len(jobs):] + jobs[: r % len(jobs)]  # rotated: no job always first
        got = {}
        for job in order:
            if in_process:  # (the tests: no interpreter start per job; peak memory is then not the job's own)
                got[key(job)] = {**job, **work(job)}
            else:
                done = subprocess.run([sys.executable, __file__, WORKER, json.dumps(job)], capture_output=True, text=True, env=env)
                if done.returncode:
                    raise SystemExit(f"job {job} failed:\n{done.stderr[-3000:]}")
                got[key(job)] = {**job, **json.loads(done.stdout.strip().splitlines()[-1])}
            if job["variant"] == "alternate":  # a record per variant of the table
                times = ", ".join(f"{r_['variant']} {r_['seconds']:.4f} s" for r_ in _records(got[key(job)]))
                print(f"round {r + 1}/{rounds}: {job['table']} {job['method']} alternated: {times}", file=sys.stderr, flush=True)
                continue
            print(f"round {r + 1}/{rounds}: {job['table']} {job['method']} {job['variant']}: {got[key(job)]['seconds']:.4f} s",
                  file=sys.stderr, flush=True)
        results.append([record for j in jobs for record in _records(got[key(j)])])
    return results


def _records(got: dict) -> list[dict]:
    """A job's result records: one, or an alternated job's record per variant."""
    if got.get("variant") != "alternate":
        return [got]
    names = variants(got)
    base = {k: v for k, v in got.items() if k not in names}
    return [{**base, **got[name]} for name in names]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def find(round_: list[dict], method: str, variant: str) -> dict:
    return next(j for j in round_ if j["method"] == method and j["variant"] == variant)


def ratios(results: dict[str, list[list[dict]]]) -> dict[str, dict[str, list[float]]]:
    """Per table and method, the ratio of each round (the figure its target is about)."""
    out: dict[str, dict[str, list[float]]] = {}
    for table, rs in results.items():
        methods = list(dict.fromkeys(j["method"] for j in rs[0]))
        if table == "window":
            out[table] = {m: [find(r, m, "window")["seconds"] / find(r, m, "full")["seconds"] for r in rs] for m in methods}
        elif table == "decode":
            lo, hi = sorted({j["cache"] for j in rs[0]})
            out[table] = {m: [find(r, m, f"cache {hi}")["per_token_s"] / find(r, m, f"cache {lo}")["per_token_s"] for r in rs]
                          for m in methods}
        else:
            out[table] = {m: [find(r, m, "mixed")["seconds"]
                              / (0.75 * find(r, m, "local")["seconds"] + 0.25 * find(r, m, "global")["seconds"]) for r in rs]
                          for m in methods}
    return out


def tables(results: dict[str, list[list[dict]]], sizes: dict) -> str:
    lines = []
    got = ratios(results)
    med = lambda rs, m, v, f="seconds": statistics.median(find(r, m, v)[f] for r in rs)  # noqa: E731
    if "window" in results:
        rs = results["window"]
        lines += [f"### Sliding window W={sizes['window']} vs full causal, N={sizes['n']}, forward + backward (B=1, "
                  f"H={sizes['heads']}, D={sizes['dim'] // sizes['heads']})", "",
                  "| method | window / full (x) | target | full s | window s | peak MB full | peak MB window |",
                  "|---|---|---|---|---|---|---|"]
        for m, values in got["window"].items():
            lines.append(f"| {m} | {spread(values)} | <= {TARGETS['window']} | {med(rs, m, 'full'):.3f} | "
                         f"{med(rs, m, 'window'):.3f} | {med(rs, m, 'full', 'peak_over_baseline_mb'):.0f} | "
                         f"{med(rs, m, 'window', 'peak_over_baseline_mb'):.0f} |")
        lines.append("")
    if "decode" in results:
        rs = results["decode"]
        lo, hi = sizes["caches"]
        lines += [f"### Decoding a windowed layer (W={sizes['window']}, dim {sizes['dim']}, {sizes['heads']} heads): "
                  f"time per token after a cache of {hi} vs {lo}, inference", "",
                  f"| method | cache {hi} / cache {lo} (x) | target | ms/token at {lo} | ms/token at {hi} | keys kept at {hi} |",
                  "|---|---|---|---|---|---|"]
        for m, values in got["decode"].items():
            lines.append(f"| {m} | {spread(values)} | <= {TARGETS['decode']} | {1e3 * med(rs, m, f'cache {lo}', 'per_token_s'):.3f} | "
                         f"{1e3 * med(rs, m, f'cache {hi}', 'per_token_s'):.3f} | {find(rs[0], m, f'cache {hi}')['kept_keys']} |")
        lines.append("")
    if "schedule" in results:
        rs = results["schedule"]
        lines += [f"### 3 local (W={sizes['window']}) : 1 global layers vs the weighted mean of its layer kinds, LM dim "
                  f"{sizes['dim']}, depth 4, {sizes['heads']} heads, N={sizes['lm_n']}, forward + backward", "",
                  "| method | 3:1 / (3/4 local + 1/4 global) (x) | target | all local s | all global s | 3:1 s |",
                  "|---|---|---|---|---|---|"]
        for m, values in got["schedule"].items():
            lines.append(f"| {m} | {spread(values)} | <= {TARGETS['schedule']} | {med(rs, m, 'local'):.3f} | "
                         f"{med(rs, m, 'global'):.3f} | {med(rs, m, 'mixed'):.3f} |")
        lines.append("")
    return "\n".join(lines)


def write(path: str, content: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(content)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) > 1 and argv[0] == WORKER:
        print(json.dumps(work(json.loads(argv[1]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tables", nargs="+", default=list(TABLES), choices=TABLES)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), help="encodings to run (default rope alibi)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and one round: checks that the script runs")
    parser.add_argument("--alternate", type=int, default=0, metavar="K",
                        help="each table's variants alternated K times in one process per method and round")
    parser.add_argument("--in-process", action="store_true",
                        help="run every job in this process (for the tests; the timings then share one interpreter)")
    parser.add_argument("--out", default="benchmarks/results/schedule")
    args = parser.parse_args(argv)
    import torch

    import posenc
    from posenc.bench.machine import cpu_model

    for m in args.methods:
        if m not in posenc.available():
            raise SystemExit(f"--methods: unknown encoding {m!r}; available: {', '.join(posenc.available())}")
    sizes = dict(QUICK if args.quick else FULL)
    rounds = 1 if args.quick else args.rounds
    started = time.time()
    if args.alternate < 0:
        raise SystemExit(f"--alternate must be 0 (off) or a positive number of alternations, got {args.alternate}")
    results = {t: measure(job_list(t, args.methods, sizes, args.alternate), rounds, args.threads, args.in_process) for t in args.tables}
    command = (f"python benchmarks/schedule.py{' --quick' if args.quick else f' --rounds {rounds}'} --tables "
               f"{' '.join(args.tables)} --methods {' '.join(args.methods)}"
               f"{'' if args.threads is None else f' --threads {args.threads}'}{' --in-process' if args.in_process else ''}"
               f"{f' --alternate {args.alternate}' if args.alternate else ''}")
    machine = {"cpu_model": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
               "threads": args.threads or torch.get_num_threads(), "platform": platform.platform()}
    header = (f"Machine: {machine['cpu_model']}, {machine['cores']} cores, torch {machine['torch']}, {machine['threads']} threads "
              f"per worker. Medians over {rounds} round(s) (min-max), each ratio inside one round. Command: `{command}`; "
              f"{time.time() - started:.0f} s.{' Quick mode: tiny sizes, the figures mean nothing.' if args.quick else ''}\n\n")
    text = header + tables(results, sizes)
    got = ratios(results)
    summary = {table: {m: {"median": statistics.median(v), "min": min(v), "max": max(v), "rounds": v,
                           "target": TARGETS[table], "meets_target": statistics.median(v) <= TARGETS[table]}
                       for m, v in per.items()} for table, per in got.items()}
    data = {"command": command, "quick": args.quick, "rounds": rounds, "sizes": {**sizes, "caches": list(sizes["caches"])},
            "machine": machine, "ratios": summary, "jobs": results, "wall_s": round(time.time() - started, 1)}
    os.makedirs(args.out, exist_ok=True)
    write(os.path.join(args.out, "table.md"), text)
    write(os.path.join(args.out, "results.json"), json.dumps(data, indent=1, allow_nan=False))
    print(text)


if __name__ == "__main__":
    main()
