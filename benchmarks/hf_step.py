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

All models live in one process and are warmed up first; then every round times one step of each
method, the methods in an order that rotates from round to round, so the steps a ratio compares
ran seconds apart (on a shared machine whose load moves by several times within a minute, separate
processes per job gave ratios that were noise). A method's ratio in a round is its time over
``hf-rope``'s time in that round and mode; the table gives the median ratio over rounds and its
min-max, and the median time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

METHODS = ["hf-rope", "rope", "alibi", "t5", "nope"]
MODES = ["train", "decode"]


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


class Runner:
    """One method's model and inputs; ``step()`` runs one timed unit of the mode, returns seconds."""

    def __init__(self, method: str, mode: str, args) -> None:
        import torch

        self.model, self.mode, self.args = build(method, args), mode, args
        g = torch.Generator().manual_seed(1)
        if mode == "train":
            self.ids = torch.randint(0, 256, (args.batch, args.length), generator=g)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
            self.model.train()
        else:
            self.ids = torch.randint(0, 256, (1, args.length), generator=g)
            self.model.eval()

    def step(self) -> float:
        import torch

        if self.mode == "train":
            return timed_step(self.model, self.ids, self.opt)
        with torch.no_grad():  # prefill untimed, then per token
            out = self.model(self.ids, use_cache=True)
            cache, token = out.cache, out.logits[:, -1:].argmax(-1)
            start = time.perf_counter()
            for _ in range(self.args.tokens):
                out = self.model(token, cache=cache, use_cache=True)
                cache, token = out.cache, out.logits[:, -1:].argmax(-1)
            return (time.perf_counter() - start) / self.args.tokens


def add_model_arguments(parser: argparse.ArgumentParser, rounds: int) -> None:
    """The options this script shares with hf_families.py: the model's sizes, the timed rounds, the
    warmup steps and the threads."""
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)


def timed_step(model: Any, ids: Any, opt: Any) -> float:
    """Seconds of one training step of ``model`` on ``ids`` (B, T), its own next-token loss."""
    start = time.perf_counter()
    loss = model(ids, labels=ids, use_cache=False).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return time.perf_counter() - start


def parsed(parser: argparse.ArgumentParser, reference: str, why: str) -> argparse.Namespace:
    """The options, ``--methods`` holding ``reference`` (``why`` says what it is), torch's threads set."""
    args = parser.parse_args()
    if reference not in args.methods:
        raise SystemExit(f"--methods must include {reference} ({why})")
    import torch

    torch.set_num_threads(args.threads)
    return args


def warmed(runners: dict[str, Any], steps: int) -> dict[str, Any]:
    """``runners`` after ``steps`` untimed steps each."""
    for runner in runners.values():
        for _ in range(steps):
            runner.step()
    return runners


def rotated(methods: list[str], r: int) -> list[str]:
    """The methods in round ``r``'s order: each starts a round in turn, so none always runs first."""
    k = r % len(methods)
    return methods[k:] + methods[:k]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/hf"))
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    parser.add_argument("--length", type=int, default=1024, help="train: tokens per row; decode: cache length")
    add_model_arguments(parser, rounds=15)
    parser.add_argument("--tokens", type=int, default=16, help="decode: timed tokens per step")
    args = parsed(parser, "hf-rope", "the reference of every ratio")
    records: dict[str, dict[str, list[float]]] = {mode: {m: [] for m in args.methods} for mode in args.modes}
    for mode in args.modes:
        runners = warmed({m: Runner(m, mode, args) for m in args.methods}, args.warmup)
        for r in range(args.rounds):
            for method in rotated(args.methods, r):
                records[mode][method].append(runners[method].step())
            print(f"round {r + 1}/{args.rounds} {mode}: " + ", ".join(
                f"{m} {records[mode][m][-1] * 1e3:.1f} ms" for m in args.methods), file=sys.stderr)
        del runners
    import torch
    import transformers

    from posenc.bench.machine import cpu_model

    lines = [
        "# posenc inside LlamaForCausalLM vs its own sdpa RoPE",
        "",
        f"CPU: {cpu_model()}, {args.threads} threads; torch {torch.__version__}, transformers {transformers.__version__}",
        f"model: hidden {args.hidden}, {args.layers} layers, {args.heads} heads / {args.kv_heads} kv heads, vocab 256, float32",
        f"train: batch {args.batch} x {args.length} tokens, forward + backward + AdamW; "
        f"decode: one token after a cache of {args.length}, per token over {args.tokens} tokens",
        f"{args.rounds} rounds of one timed step per method (order rotated each round), after {args.warmup} warm-up step(s); one process",
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
