"""A training step of every family in posenc's table inside ``transformers``: the untouched model
against ``posenc.hf.use(model, m)`` for m in rope (the model's own schedule), alibi and t5.

    PYTHONPATH=src:tests python benchmarks/hf_families.py --out benchmarks/results/hf-families

Each family's model is built from its tiny test config (tests/hf_family_configs.py) scaled up:
hidden 256, 4 layers, 8 query heads, 4 key/value heads (MLA: 8), head dim 32, its windows and
chunks at a quarter of the length, random weights, float32, its default attention (sdpa where the
family has it, else eager: Gemma 2, gpt-oss). A step is forward + backward + AdamW on (batch, N)
tokens, ``use_cache=False``. Per family, all its models live in one process and every round times
``--steps`` consecutive steps of each method in an order that rotates from round to round and keeps
the fastest of them (a step that met a page fault storm or another process is not the method's
cost), so the steps a ratio compares ran seconds apart; a method's ratio in a round is its time
over the untouched model's in that round. The table gives, per family and method, the median ratio over rounds and its min-max.
Targets (issue 33): rope within 1.10x, alibi and t5 within 1.30x.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from hf_step import add_model_arguments, parsed, rotated, timed_step, warmed  # (benchmarks/, this script's folder)

METHODS = ["hf", "rope", "alibi", "t5"]


def build(model_type: str, method: str, args):
    import torch
    import transformers

    from hf_family_configs import config_kwargs

    transformers.logging.set_verbosity_error()
    sizes = dict(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                 num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                 vocab_size=256, max_position_embeddings=max(4096, 2 * args.length), sliding_window=args.length // 4)
    config = transformers.AutoConfig.for_model(model_type, **config_kwargs(model_type, **sizes))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if method != "hf":
        import posenc.hf

        posenc.hf.use(model, method)
    return model.train()


class Runner:
    def __init__(self, model_type: str, method: str, args) -> None:
        import torch

        self.model = build(model_type, method, args)
        self.ids = torch.randint(0, 256, (args.batch, args.length), generator=torch.Generator().manual_seed(1))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def step(self) -> float:
        return timed_step(self.model, self.ids, self.opt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/hf-families"))
    parser.add_argument("--families", nargs="+", default=None, help="model_types (default: every tested family)")
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument("--length", type=int, default=1024)
    add_model_arguments(parser, rounds=5)
    parser.add_argument("--steps", type=int, default=3, help="steps timed per method and round (the fastest kept)")
    args = parsed(parser, "hf", "the untouched model, the reference of every ratio")
    import torch
    import transformers

    from hf_family_configs import TESTED
    from posenc.bench.machine import cpu_model
    from posenc.files import write_json, write_text

    families = args.families or list(TESTED)
    records: dict[str, dict[str, list[float]]] = {}
    for family in families:
        runners = warmed({m: Runner(family, m, args) for m in args.methods}, args.warmup)
        records[family] = {m: [] for m in args.methods}
        for r in range(args.rounds):
            for method in rotated(args.methods, r):
                records[family][method].append(min(runners[method].step() for _ in range(args.steps)))
        ref = records[family]["hf"]
        print(f"{family}: " + ", ".join(f"{m} {statistics.median([t / b for t, b in zip(records[family][m], ref)]):.2f}x"
                                        for m in args.methods), file=sys.stderr, flush=True)
        del runners
    head = [
        "# A training step inside transformers: posenc.hf against the untouched model, per family",
        "",
        f"CPU: {cpu_model()}, {args.threads} threads; torch {torch.__version__}, transformers {transformers.__version__}",
        f"model: hidden {args.hidden}, {args.layers} layers, {args.heads} heads / {args.kv_heads} kv heads, vocab 256, "
        f"float32; windows and chunks {args.length // 4}",
        f"step: batch {args.batch} x {args.length} tokens, forward + backward + AdamW; {args.rounds} rounds per family "
        f"(order rotated each round), the fastest of {args.steps} steps a round, after {args.warmup} warm-up step(s); "
        "one process",
        "",
        "| family | untouched step (ms) | " + " | ".join(f"{m} / untouched" for m in args.methods if m != "hf") + " |",
        "|---|---|" + "---|" * (len(args.methods) - 1),
    ]
    for family in families:
        ref = records[family]["hf"]
        cells = []
        for method in args.methods:
            if method == "hf":
                continue
            ratios = [t / b for t, b in zip(records[family][method], ref)]
            cells.append(f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
        head.append(f"| {family} | {statistics.median(ref) * 1e3:.1f} | " + " | ".join(cells) + " |")
    table = "\n".join(head) + "\n"
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    write_text(args.out / "table.md", table)
    write_json(args.out / "results.json", {
        "command": " ".join(["python", "benchmarks/hf_families.py", *sys.argv[1:]]), "cpu": cpu_model(),
        "torch": torch.__version__, "transformers": transformers.__version__, "times_s": records})


if __name__ == "__main__":
    main()
