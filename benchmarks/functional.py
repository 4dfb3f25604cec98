"""Benchmarks of posenc.attend, the functional call (issue "posenc inside any model").

Four tables, each measured in rounds: every job of a table runs once per round in a fresh process
(the peak resident memory is then the job's own), the order rotated from round to round, and every
ratio is taken inside one round before the median and min-max over rounds are reported.

1. ``workaround``: posenc.attend against what users had without it, at N tokens, forward +
   backward (B=1, H=8, D=64): the encoding's dense ``bias(pos, pos)`` plus the causal mask as
   SDPA's ``attn_mask``; Shaw and Transformer-XL have no such workaround, so the eager formula.
2. ``gqa``: each method's time / NoPE's with 8 query heads and 8 KV heads (MHA) and with 2 KV
   heads (GQA), N=2048, forward + backward.
3. ``packed``: a row of 4096 tokens holding 8 documents of 512 (document_ids), against the same
   8 documents as a batch of 8 x 512 and against one 4096 call with a dense block-diagonal mask.
4. ``compile``: an LM training step (dim 256, depth 4, 8 heads, N=512) compiled with inductor
   against eager; the first compile's time.

Usage: ``python benchmarks/functional.py [--rounds 3] [--reps R] [--tables workaround gqa packed compile]
[--out benchmarks/results/functional]``. Writes table.md and results.json into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WORKER = "--worker"


def job_list(table: str, n: int) -> list[dict]:
    if table == "workaround":
        jobs = []
        for m in ("alibi", "t5", "kerple", "fire"):
            jobs += [{"table": table, "method": m, "variant": v, "n": n} for v in ("workaround", "attend")]
        for m in ("shaw", "transformer_xl"):
            jobs += [{"table": table, "method": m, "variant": v, "n": n} for v in ("eager", "attend")]
        return jobs + [{"table": table, "method": "nope", "variant": "attend", "n": n}]
    if table == "gqa":
        return [{"table": table, "method": m, "variant": v, "n": 2048} for m in ("nope", "rope", "alibi", "t5", "kerple", "shaw")
                for v in ("mha", "gqa")]
    if table == "packed":
        return [{"table": table, "method": m, "variant": v, "n": 4096} for m in ("nope", "rope", "alibi", "t5")
                for v in ("packed", "batch", "dense")]
    if table == "compile":
        return [{"table": table, "method": m, "variant": v, "n": 512} for m in ("nope", "rope", "alibi") for v in ("eager", "compiled")]
    raise SystemExit(f"unknown table {table!r}")


# ------------------------------------------------------------------------------------------------
# The worker: one job, timed, in its own process


def work(job: dict) -> dict:
    import torch
    import torch.nn.functional as F

    import posenc
    from posenc.bench.worker import timed
    from posenc.encodings.protocol import DistanceBias, Rotates, offers

    torch.manual_seed(0)
    table, method, variant, n = job["table"], job["method"], job["variant"], job["n"]
    h, d = 8, 64
    if table == "compile":
        model = posenc.LM(posenc.LMConfig(encoding=method, dim=256, depth=4, num_heads=8))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        fn = torch.compile(model) if variant == "compiled" else model
        tokens = torch.randint(0, 256, (1, n))

        def step():
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(fn(tokens).view(-1, 256), tokens.view(-1)).backward()
            opt.step()

        t0 = time.perf_counter()
        step()
        first = time.perf_counter() - t0
        return {**timed(step, job.get("reps") or 3), "first_s": first}
    enc = posenc.build(method, num_heads=h, head_dim=d)
    hkv = 2 if variant == "gqa" else h
    b = 8 if variant == "batch" else 1
    t = 512 if variant == "batch" else n
    q = torch.randn(b, h, t, d, requires_grad=True)
    k = torch.randn(b, hkv, t, d, requires_grad=True)
    v = torch.randn(b, hkv, t, d, requires_grad=True)
    pos = torch.arange(t)
    if variant == "workaround":
        def run():
            causal = torch.zeros(t, t).masked_fill_(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=enc.bias(pos, pos) + causal)
    elif variant == "eager":
        def run():
            return posenc.attend(q, k, v, enc, backend="eager")
    elif variant == "packed":
        doc = torch.arange(n)[None] // 512

        def run():
            return posenc.attend(q, k, v, enc, document_ids=doc)
    elif variant == "dense":
        doc = torch.arange(n) // 512
        inner = (pos[None, :] % 512) - (pos[:, None] % 512)  # in-document distance j - i
        blockdiag = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])

        def run():
            qq, kk = enc.rotate(q, k, pos % 512, pos % 512) if offers(enc, Rotates) else (q, k)
            mask = torch.zeros(t, t).masked_fill_(~blockdiag, float("-inf"))
            if offers(enc, DistanceBias):
                mask = mask + enc.relative_bias(inner)
            return F.scaled_dot_product_attention(qq, kk, v, attn_mask=mask)
    else:  # attend, mha, gqa, batch
        def run():
            return posenc.attend(q, k, v, enc)

    def step():
        out = run()
        out.sum().backward()

    slow = variant in ("workaround", "eager", "dense") and n >= 4096  # seconds per step: one timed step is enough
    return timed(step, 1 if slow else job.get("reps") or 2)



# ------------------------------------------------------------------------------------------------
# The parent: rounds, ratios, tables



def measure(jobs: list[dict], rounds: int) -> list[list[dict]]:
    results = []
    for r in range(rounds):
        order = jobs[r % len(jobs):] + jobs[: r % len(jobs)]  # rotated: no job always first
        got = {}
        for job in order:
            done = subprocess.run([sys.executable, __file__, WORKER, json.dumps(job)], capture_output=True, text=True,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
            if done.returncode:
                raise SystemExit(f"job {job} failed:\n{done.stderr[-3000:]}")
            got[json.dumps(job, sort_keys=True)] = {**job, **json.loads(done.stdout.strip().splitlines()[-1])}
            print(f"round {r + 1}/{rounds}: {job['table']} {job['method']} {job['variant']}: "
                  f"{got[json.dumps(job, sort_keys=True)]['seconds']:.3f} s", flush=True)
        results.append([got[json.dumps(j, sort_keys=True)] for j in jobs])
    return results


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def find(round_: list[dict], method: str, variant: str) -> dict:
    return next(j for j in round_ if j["method"] == method and j["variant"] == variant)


def present(rs: list[list[dict]], methods) -> list[str]:
    """The methods of ``methods`` that this run measured (a run may be limited with --methods)."""
    seen = {j["method"] for j in rs[0]}
    return [m for m in methods if m in seen]


def tables(results: dict[str, list[list[dict]]]) -> str:
    lines = []
    if "workaround" in results:
        rs = results["workaround"]
        n = rs[0][0]["n"]
        lines += [f"### posenc.attend vs the workaround, N={n}, forward + backward (B=1, H=8, D=64)", "",
                  "| method | workaround | speed-up of attend (x) | attend / NoPE | peak MB workaround | peak MB attend |",
                  "|---|---|---|---|---|---|"]
        for m in present(rs, ("alibi", "t5", "kerple", "fire", "shaw", "transformer_xl")):
            other = "workaround" if m not in ("shaw", "transformer_xl") else "eager"
            speed = [find(r, m, other)["seconds"] / find(r, m, "attend")["seconds"] for r in rs]
            to_nope = [find(r, m, "attend")["seconds"] / find(r, "nope", "attend")["seconds"] for r in rs]
            mem_w = statistics.median(find(r, m, other)["peak_over_baseline_mb"] for r in rs)
            mem_a = statistics.median(find(r, m, "attend")["peak_over_baseline_mb"] for r in rs)
            lines.append(f"| {m} | {other} | {spread(speed)} | {spread(to_nope)} | {mem_w:.0f} | {mem_a:.0f} |")
        lines.append("")
    if "gqa" in results:
        rs = results["gqa"]
        lines += ["### Grouped-query heads: ratio to NoPE with the same heads, N=2048, forward + backward", "",
                  "| method | MHA (8 KV heads) | GQA (2 KV heads) |", "|---|---|---|"]
        for m in present(rs, ("nope", "rope", "alibi", "t5", "kerple", "shaw")):
            cells = [spread([find(r, m, v)["seconds"] / find(r, "nope", v)["seconds"] for r in rs]) for v in ("mha", "gqa")]
            lines.append(f"| {m} | {cells[0]} | {cells[1]} |")
        lines.append("")
    if "packed" in results:
        rs = results["packed"]
        lines += ["### A packed row of 4096 tokens (8 documents of 512), forward + backward", "",
                  "| method | packed / batch of 8 x 512 | dense block-diagonal mask / packed | peak MB packed | peak MB dense |",
                  "|---|---|---|---|---|"]
        for m in present(rs, ("nope", "rope", "alibi", "t5")):
            a = spread([find(r, m, "packed")["seconds"] / find(r, m, "batch")["seconds"] for r in rs])
            b = spread([find(r, m, "dense")["seconds"] / find(r, m, "packed")["seconds"] for r in rs])
            pm = statistics.median(find(r, m, "packed")["peak_over_baseline_mb"] for r in rs)
            dm = statistics.median(find(r, m, "dense")["peak_over_baseline_mb"] for r in rs)
            lines.append(f"| {m} | {a} | {b} | {pm:.0f} | {dm:.0f} |")
        lines.append("")
    if "compile" in results:
        rs = results["compile"]
        lines += ["### torch.compile (inductor): LM training step, dim 256, depth 4, 8 heads, N=512", "",
                  "| method | eager / compiled (x, > 1: compiled faster) | first compiled step (s) |", "|---|---|---|"]
        for m in present(rs, ("nope", "rope", "alibi")):
            ratio = spread([find(r, m, "eager")["seconds"] / find(r, m, "compiled")["seconds"] for r in rs])
            first = statistics.median(find(r, m, "compiled")["first_s"] for r in rs)
            lines.append(f"| {m} | {ratio} | {first:.1f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == WORKER:
        print(json.dumps(work(json.loads(sys.argv[2]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--n", type=int, default=4096, help="tokens of the workaround table")
    parser.add_argument("--tables", nargs="+", default=["workaround", "gqa", "packed", "compile"])
    parser.add_argument("--methods", nargs="+", default=None, help="only these methods' jobs (NoPE's always run: the ratios need it)")
    parser.add_argument("--reps", type=int, default=None,
                        help="timed steps per job, the fastest kept (default: 2, 3 for compile, 1 for a dense N >= 4096 job)")
    parser.add_argument("--out", default="benchmarks/results/functional")
    args = parser.parse_args()
    import torch

    from posenc.bench.machine import cpu_model

    started = time.time()
    keep = None if args.methods is None else {*args.methods, "nope"}
    if args.reps is not None and args.reps < 1:
        raise SystemExit(f"--reps must be a positive integer, got {args.reps}")
    results = {t: measure([{**j, "reps": args.reps} for j in job_list(t, args.n) if keep is None or j["method"] in keep], args.rounds)
               for t in args.tables}
    header = (f"Machine: {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads. "
              f"Medians over {args.rounds} rounds (min-max), each ratio inside one round. "
              f"Command: `python benchmarks/functional.py --rounds {args.rounds} --n {args.n} --tables {' '.join(args.tables)}"
              f"{'' if args.methods is None else ' --methods ' + ' '.join(args.methods)}"
              f"{'' if args.reps is None else f' --reps {args.reps}'}`; "
              f"{time.time() - started:.0f} s.\n\n")
    os.makedirs(args.out, exist_ok=True)
    text = header + tables(results)
    for name, content in (("table.md", text), ("results.json", json.dumps(results, indent=1, allow_nan=False))):
        tmp = os.path.join(args.out, name + ".tmp")
        with open(tmp, "w") as f:
            f.write(content)
        os.replace(tmp, os.path.join(args.out, name))
    print(text)


if __name__ == "__main__":
    main()
