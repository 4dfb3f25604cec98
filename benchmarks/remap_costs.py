"""What the training-free position remaps cost against plain RoPE, on SmolLM2-135M's shapes.

Not a test: a benchmark. Three levels, each in alternated rounds (the methods' order rotated every
round, the ratio to plain RoPE taken inside a round; median and min-max over rounds):

- ``attention``: one attention call's forward at ``--length`` tokens (default 16,384) with SmolLM2's
  heads (9 query, 3 key/value, head dim 64): ``posenc.attend`` with the remap against
  ``posenc.attend`` with plain RoPE (both on the CPU flash kernel);
- ``decode``: one decode step of the whole SmolLM2 model (GGUF, float32) at a KV cache of ``--length``
  keys: ``posenc.hf.use(model, remap)`` against the untouched model (transformers' SDPA, keys kept
  rotated). The cache is filled with random keys and values (a step's cost does not depend on them);
  each method first takes one step, which rotates and keeps its far regions' keys, then ``--steps``
  timed steps;
- ``model``: one forward of the whole model at ``--length`` tokens (``--levels model``: about 100 s a
  pass on 2 cores, so not in the default run).

    .venv/bin/python benchmarks/remap_costs.py --out benchmarks/results/remap-costs

Writes ``results.json`` and ``table.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

import posenc
from posenc.bench.machine import cpu_model
from posenc.files import write_json, write_text

H, HKV, D, BASE = 9, 3, 64, 1e5
METHODS: dict[str, dict[str, Any]] = {
    "selfextend": {"group": 4, "window": 1024},
    "rerope": {"window": 2048},
    "string": {"shift": 8320, "local": 128},
    "dca": {"chunk_size": 6144, "local_size": 1024},
}


def best(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` calls, in seconds (after one untimed call)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def attention_level(length: int, repeats: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> dict[str, Callable[[], float]]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, length, D, device=device, dtype=dtype) for h in (H, HKV, HKV))
    encs = {"rope": posenc.build("rope", num_heads=H, head_dim=D, base=BASE)}
    encs.update({m: posenc.build(m, num_heads=H, head_dim=D, base=BASE, **o) for m, o in METHODS.items()})

    def timer(enc) -> Callable[[], float]:
        def call() -> None:
            posenc.attend(q, k, v, enc)
            if q.device.type == "cuda":
                torch.cuda.synchronize()

        def run() -> float:
            with torch.no_grad():
                return best(call, repeats)
        return run
    return {m: timer(e) for m, e in encs.items()}


def _models():
    import posenc.hf
    from posenc.hf.checkpoints import load_pretrained, smollm2_gguf

    base, _ = load_pretrained(smollm2_gguf())
    models = {"rope": base}
    models.update({m: posenc.hf.use(copy.deepcopy(base), m, **o) for m, o in METHODS.items()})
    return models


def decode_level(length: int, steps: int) -> dict[str, Callable[[], float]]:
    import transformers

    models = _models()

    def timer(model) -> Callable[[], float]:
        def run() -> float:
            torch.manual_seed(0)
            cache = transformers.DynamicCache(config=model.config)
            with torch.no_grad():
                model(torch.tensor([[1]]), past_key_values=cache, use_cache=True)
                for layer in cache.layers:  # a cache of `length` random keys and values
                    layer.keys = torch.randn(1, HKV, length, D)
                    layer.values = torch.randn(1, HKV, length, D)
                token = torch.tensor([[2]])

                def step(at: list[int] = [length]) -> None:
                    model(token, past_key_values=cache, use_cache=True, position_ids=torch.tensor([[at[0]]]))
                    at[0] += 1
                step()  # the first step rotates and keeps a remap's far keys
                times = []
                for _ in range(steps):
                    start = time.perf_counter()
                    step()
                    times.append(time.perf_counter() - start)
            return statistics.median(times)
        return run
    return {m: timer(model) for m, model in models.items()}


def model_level(length: int) -> dict[str, Callable[[], float]]:
    models = _models()
    ids = torch.randint(3, 49152, (1, length), generator=torch.Generator().manual_seed(0))

    def timer(model) -> Callable[[], float]:
        def run() -> float:
            with torch.no_grad():
                start = time.perf_counter()
                model.model(input_ids=ids)
                return time.perf_counter() - start
        return run
    return {m: timer(model) for m, model in models.items()}


def rounds(timers: dict[str, Callable[[], float]], n: int) -> dict[str, Any]:
    names = list(timers)
    ratios: dict[str, list[float]] = {m: [] for m in names if m != "rope"}
    seconds: dict[str, list[float]] = {m: [] for m in names}
    for r in range(n):
        order = names[r % len(names):] + names[: r % len(names)]
        got = {m: timers[m]() for m in order}
        for m in names:
            seconds[m].append(got[m])
        for m in ratios:
            ratios[m].append(got[m] / got["rope"])
        print(f"round {r}: " + ", ".join(f"{m} {got[m] * 1e3:.1f} ms" for m in names), file=sys.stderr, flush=True)
    return {"seconds": seconds, "ratios": ratios,
            "summary": {m: {"median": statistics.median(v), "min": min(v), "max": max(v)} for m, v in ratios.items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/remap-costs")
    p.add_argument("--levels", nargs="+", default=["attention", "decode"], choices=["attention", "decode", "model"])
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2, help="attention: calls per method per round (the fastest kept)")
    p.add_argument("--steps", type=int, default=20, help="decode: timed steps per method per round (the median kept)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="attention level only: cpu, or cuda (bfloat16)")
    args = p.parse_args()
    if args.device != "cpu" and args.levels != ["attention"]:
        raise SystemExit("--device: only the attention level runs off the CPU (--levels attention)")
    torch.set_num_threads(args.threads)
    results: dict[str, Any] = {"machine": {"cpu": cpu_model(), "threads": args.threads, "torch": torch.__version__,
                                           "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"},
                               "length": args.length, "methods": METHODS, "levels": {}}
    for level in args.levels:
        if level == "attention":
            timers = attention_level(args.length, args.repeats, args.device,
                                     torch.float32 if args.device == "cpu" else torch.bfloat16)
        elif level == "decode":
            timers = decode_level(args.length, args.steps)
        else:
            timers = model_level(args.length)
        results["levels"][level] = rounds(timers, args.rounds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", results)
    lines = [f"{results['machine']['cpu']}, {args.threads} threads, torch {torch.__version__}; length {args.length}; "
             f"{args.rounds} alternated rounds, ratio to plain RoPE inside a round: median (min-max).", "",
             "| method | " + " | ".join(args.levels) + " |", "|---|" + "---|" * len(args.levels)]
    for m in METHODS:
        cells = []
        for level in args.levels:
            s = results["levels"][level]["summary"][m]
            cells.append(f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    rope = {level: statistics.median(results["levels"][level]["seconds"]["rope"]) for level in args.levels}
    lines += ["", "plain RoPE: " + ", ".join(f"{level} {t * 1e3:.1f} ms" for level, t in rope.items())]
    write_text(out / "table.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
