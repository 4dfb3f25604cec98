"""posenc inside a Hugging Face LlamaForCausalLM: a training step and a decode step, timed against
the same model with its own sdpa RoPE.

    PYTHONPATH=src python benchmarks/hf_step.py --out benchmarks/results/hf

The model is built from a config (random weights): hidden 256, 4 layers, 8 query heads and 4
key/value heads (grouped-query attention), head dim 32, vocab 256, float32 on the CPU. Methods:
``hf-rope`` (the untouched model, ``attn_implementation="sdpa"``), then ``posenc.hf.use(model, m)``
for m in rope (the model's own parameters), alibi, t5 and nope.

- train: forward + backward + AdamW step on a (batch, N) batch of tokens, ``use_cache=False``.
- decode: one greedy token after a cache of N tokens (a prefill, untimed), per token over ``--tokens``
  tokens.

Every (round, method, mode) runs in a fresh interpreter: warm-up steps untimed, then ``--repeats``
timed steps, their median is the job's time. Rounds alternate the methods (the order rotates every
round); a method's ratio in a round is its time over ``hf-rope``'s time of the same round and mode.
The table gives the median ratio over rounds and its min-max, and the median time.
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
from pathlib import Path

METHODS = ["hf-rope", "rope", "alibi", "t5", "nope"]
MODES = ["train", "decode"]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def build(method: str, args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         max_position_embeddings=max(4096, 2 * args.length), attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    if method != "hf-rope":
        import posenc.hf

        posenc.hf.use(model, method)
    return model


def job(method: str, mode: str, args) -> dict:
    """One fresh-process measurement: {"times": [...], "median": s}."""
    import torch

    torch.set_num_threads(args.threads)
    model = build(method, args)
    g = torch.Generator().manual_seed(1)
    times = []
    if mode == "train":
        ids = torch.randint(0, 256, (args.batch, args.length), generator=g)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model.train()
        for step in range(args.warmup + args.repeats):
            start = time.perf_counter()
            loss = model(ids, labels=ids, use_cache=False).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
    else:
        model.eval()
        ids = torch.randint(0, 256, (1, args.length), generator=g)
        with torch.no_grad():
            for step in range(args.warmup + args.repeats):
                out = model(ids, use_cache=True)
                cache, token = out.cache, out.logits[:, -1:].argmax(-1)
                start = time.perf_counter()
                for _ in range(args.tokens):
                    out = model(token, cache=cache, use_cache=True)
                    cache, token = out.cache, out.logits[:, -1:].argmax(-1)
                if step >= args.warmup:
                    times.append((time.perf_counter() - start) / args.tokens)
    return {"times": times, "median": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/hf"))
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    parser.add_argument("--length", type=int, default=1024, help="train: tokens per row; decode: cache length")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=16, help="decode: timed tokens per step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--job", help=argparse.SUPPRESS)  # internal: method,mode (a worker process)
    args = parser.parse_args()
    if args.job:
        method, mode = args.job.split(",")
        print(json.dumps(job(method, mode, args)))
        return
    if "hf-rope" not in args.methods:
        raise SystemExit("--methods must include hf-rope (the reference of every ratio)")
    passthrough = [f"--{k}={v}" for k, v in (("length", args.length), ("batch", args.batch), ("hidden", args.hidden),
                   ("layers", args.layers), ("heads", args.heads), ("kv-heads", args.kv_heads), ("repeats", args.repeats),
                   ("warmup", args.warmup), ("tokens", args.tokens), ("threads", args.threads))]
    records: dict[str, dict[str, list[float]]] = {mode: {m: [] for m in args.methods} for mode in args.modes}
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    for r in range(args.rounds):
        order = args.methods[r % len(args.methods):] + args.methods[: r % len(args.methods)]
        for mode in args.modes:
            for method in order:
                done = subprocess.run([sys.executable, __file__, *passthrough, "--job", f"{method},{mode}"],
                                      capture_output=True, text=True, env=env, check=True)
                result = json.loads(done.stdout.strip().splitlines()[-1])
                records[mode][method].append(result["median"])
                print(f"round {r + 1}/{args.rounds} {mode:6s} {method:8s} {result['median'] * 1e3:9.2f} ms", file=sys.stderr)
    import torch
    import transformers

    lines = [
        "# posenc inside LlamaForCausalLM vs its own sdpa RoPE",
        "",
        f"CPU: {cpu_model()}, {args.threads} threads; torch {torch.__version__}, transformers {transformers.__version__}",
        f"model: hidden {args.hidden}, {args.layers} layers, {args.heads} heads / {args.kv_heads} kv heads, vocab 256, float32",
        f"train: batch {args.batch} x {args.length} tokens, forward + backward + AdamW; "
        f"decode: one token after a cache of {args.length}, per token over {args.tokens} tokens",
        f"{args.rounds} rounds, methods alternated; each job a fresh process, {args.warmup} warm-up + {args.repeats} timed steps (median)",
        "",
        "| mode | method | median time (ms) | ratio to hf-rope, median (min-max over rounds) |",
        "|---|---|---|---|",
    ]
    for mode in args.modes:
        ref = records[mode]["hf-rope"]
        for method in args.methods:
            ts = records[mode][method]
            ratios = [t / b for t, b in zip(ts, ref)]
            lines.append(f"| {mode} | {method} | {statistics.median(ts) * 1e3:.2f} | "
                         f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |")
    table = "\n".join(lines) + "\n"
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(table)
    (args.out / "results.json").write_text(json.dumps({
        "command": " ".join(["python", "benchmarks/hf_step.py", *sys.argv[1:]]), "cpu": cpu_model(),
        "torch": torch.__version__, "transformers": transformers.__version__, "times_s": records,
    }, indent=1))


if __name__ == "__main__":
    main()
