"""A training step of the families posenc.hf covers inside ``transformers``: the untouched model
against ``posenc.hf.use(model, m)`` for m in rope (the model's own schedule), alibi and t5.

    PYTHONPATH=src:tests python benchmarks/hf_families.py --out benchmarks/results/hf-families
    PYTHONPATH=src:tests python benchmarks/hf_families.py --set all --resume --out benchmarks/results/hf-families-all

``--set`` picks the groups and ``--families`` names model types (benchmarks/hf_family_sets.py says
which families each group holds and how each is built at the benchmark's sizes).

What is trained: a causal LM on its next-token loss (a census-built one from its logits); a bare
backbone (an M-RoPE text model, a family without a causal-LM class) on its last hidden states
against its input embeddings, next token; an encoder (masked LM, bidirectional) with every token a
label. Random weights, float32, the family's default attention (sdpa where it has it), attention
dropout 0 (posenc.hf refuses to train with it; Jina v3 defaults to 0.1). A step is forward +
backward + AdamW on (batch, N) tokens, ``use_cache=False`` for the decoders. Per family, all its models live in one
process and every round times ``--steps`` consecutive steps of each method in an order that rotates
from round to round and keeps the fastest of them (a step that met a page fault storm or another
process is not the method's cost), so the steps a ratio compares ran seconds apart; a method's ratio
in a round is its time over the untouched model's in that round. The table gives, per family and
method, the median ratio over rounds and its min-max. A method that ``use()`` refuses (a UsageError)
reads "refused" (the message is in results.json); one that fails later reads "failed".
``results.json`` is rewritten after each family; ``--resume`` keeps the families of an existing one
measured with the same settings. Targets (issues 33, 47): rope within 1.10x, alibi and t5 within 1.30x.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from hf_family_sets import (  # (benchmarks/, this script's folder)
    SETS,
    _sections,
    _tests_modules,
    census_model,
    group_of,
    groups,
    length_values,
    scaled_values,
    sizes_of,
    source,
    tested_model,
)
from hf_step import add_model_arguments, parsed, rotated, timed_step

METHODS = ["hf", "rope", "alibi", "t5"]


def loss(model: Any, ids: Any, kind: str) -> Any:
    """The training loss of ``model`` on ``ids`` (B, T): next token (a causal LM; a backbone through
    its input embeddings), or every token a label (a masked LM)."""
    import torch.nn.functional as F

    if kind == "masked-lm":
        return model(ids, labels=ids).loss
    if kind == "backbone":
        hidden = model(ids, use_cache=False).last_hidden_state  # (B, T, C)
        scores = hidden[:, :-1] @ model.get_input_embeddings().weight.T  # (B, T-1, V)
    else:  # from the logits, not labels=: GIT shifts its labels past image tokens it was not given
        scores = model(ids, use_cache=False).logits[:, :-1]  # (B, T-1, V)
    return F.cross_entropy(scores.flatten(0, 1), ids[:, 1:].flatten())


class NoRope(Exception):
    """A census family whose built model does not rotate (skipped)."""


class Runner:
    """One method's model, its ids and optimizer; ``step()`` is one timed training step (seconds)."""

    def __init__(self, model: Any, kind: str, ids: Any) -> None:
        import torch

        self.model, self.kind, self.ids = model.train(), kind, ids
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def step(self) -> float:
        if self.kind == "tested":
            return timed_step(self.model, self.ids, self.opt)
        start = time.perf_counter()
        value = loss(self.model, self.ids, self.kind)
        self.opt.zero_grad(set_to_none=True)
        value.backward()
        self.opt.step()
        return time.perf_counter() - start


def runners(model_type: str, group: str, args: argparse.Namespace) -> tuple[dict[str, Runner], dict[str, str], str, str, str]:
    """The family's runners by method (each warmed up), the methods refused or failed (message), the
    sizes it ran at, "scaled" or "tiny", and what was tried before (the sizes that did not build or
    run, or where ``use(model, "rope")`` was refused while smaller ones were accepted)."""
    import copy

    import torch

    import hf_census_configs as census
    import posenc.hf
    from posenc.errors import UsageError

    kind = source(model_type, group)
    # (scale, M-RoPE sections split evenly): the scaled sizes; with M-RoPE refused there, even sections; then the tiny ones
    attempts = [("scaled", False)] if kind == "tested" else [("scaled", False), ("scaled", True), ("tiny", False)]

    def make(scale: str, even: bool) -> Any:
        if kind == "tested":
            return tested_model(model_type, args)
        if scale == "scaled":
            return census_model(model_type, kind, scaled_values(args), args.layers, even)
        return census_model(model_type, kind, length_values(args), None)

    def refusal(model: Any) -> str | None:
        try:
            posenc.hf.use(copy.deepcopy(model), "rope")
        except UsageError as error:
            return str(error)
        return None

    built: list[tuple[str, Any, Runner, Any]] = []  # (scale, model, its warmed-up runner, ids)
    errors: list[str] = []
    for scale, even in attempts:
        if even and not (built and _sections(built[-1][1])):  # the even sections: only after an M-RoPE model refused
            continue
        try:
            model = make(scale, even)
            # the census's ids, [3, 64), fit every table of its models (Gemma 4's per-layer inputs keep a vocabulary of 64)
            low, high = (0, 256) if kind == "tested" else (3, census.VOCAB)
            ids = torch.randint(low, high, (args.batch, args.length), generator=torch.Generator().manual_seed(1))  # (B, T)
            probe = Runner(copy.deepcopy(model), kind, ids)
            for _ in range(max(1, args.warmup)):
                probe.step()
        except Exception as error:  # the family's own code at these sizes: try the next
            errors.append(f"{scale}{' (even sections)' if even else ''}: {type(error).__name__}: {str(error)[:300]}")
            continue
        built.append((scale, model, probe, ids))
        why = refusal(model) if scale == "scaled" and len(attempts) > 1 else None
        if why is None:
            break
        # refused at the scaled sizes (Qwen3-VL's sections refitted beyond what posenc interleaves): the next try, if accepted there
        errors.append(f"{scale}{' (even sections)' if even else ''}: use(model, 'rope') refused at these sizes: {why[:300]}")
    if not built:
        raise RuntimeError("; ".join(errors))
    if len(built) > 1 and refusal(built[-1][1]) is not None:  # refused at every size: the scaled model's refusals
        built, errors = built[:1], []
    scale, ref, probe, ids = built[-1]
    if group == "census" and not census.uses_rope(ref):
        raise NoRope("no RoPE in the built model")
    found: dict[str, Runner] = {"hf": probe}
    left: dict[str, str] = {}
    for method in args.methods:
        if method == "hf":
            continue
        model = copy.deepcopy(ref)
        try:
            posenc.hf.use(model, method)
        except UsageError as error:
            left[method] = f"refused: {error}"
            continue
        try:
            runner = Runner(model, kind, ids)
            for _ in range(max(1, args.warmup)):
                runner.step()
        except UsageError as error:  # posenc refusing at the first step (training with what it cannot train)
            left[method] = f"refused: at the first step: {error}"
            continue
        except Exception as error:  # accepted, then failing: a defect the census should catch
            left[method] = f"failed: {type(error).__name__}: {str(error)[:300]}"
            continue
        found[method] = runner
    return found, left, sizes_of(ref), scale, "; ".join(errors)


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """What a result depends on: a resumed run keeps families measured with the same."""
    return {k: getattr(args, k) for k in ("length", "batch", "hidden", "layers", "heads", "kv_heads", "rounds", "steps", "warmup",
                                          "threads", "methods")}


def cell(times: list[float], ref: list[float]) -> str:
    ratios = [t / b for t, b in zip(times, ref)]
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def table(args: argparse.Namespace, families: list[str], data: dict[str, Any]) -> str:
    import torch
    import transformers

    from posenc.bench.machine import cpu_model

    others = [m for m in args.methods if m != "hf"]
    lines = [
        "# A training step inside transformers: posenc.hf against the untouched model, per family",
        "",
        f"CPU: {cpu_model()}, {args.threads} threads; torch {torch.__version__}, transformers {transformers.__version__}",
        f"model: hidden {args.hidden}, {args.layers} layers, {args.heads} heads / {args.kv_heads} kv heads, vocab 256, float32, "
        f"where the family allows (the model column: what each ran at); windows and chunks {args.length // 4}",
        f"step: batch {args.batch} x {args.length} tokens, forward + backward + AdamW; {args.rounds} rounds per family "
        f"(order rotated each round), the fastest of {args.steps} steps a round, after {max(1, args.warmup)} warm-up step(s); one process",
        "",
        "| family | group | model | untouched step (ms) | " + " | ".join(f"{m} / untouched" for m in others) + " |",
        "|---|---|---|---|" + "---|" * len(others),
    ]
    notes = []
    for family in families:
        if family in data["failed"]:
            notes.append(f"- {family}: not measured: {data['failed'][family]}")
            continue
        if family in data["skipped"]:
            notes.append(f"- {family}: skipped: {data['skipped'][family]}")
            continue
        info, times, left = data["families"][family], data["times_s"][family], data["refused"].get(family, {})
        ref = times["hf"]
        cells = [cell(times[m], ref) if m in times else left.get(m, "?").split(":")[0] for m in others]
        model = info["sizes"] + (" (tiny)" if info["scale"] == "tiny" else "")
        lines.append(f"| {family} | {info['group']} | {model} | {statistics.median(ref) * 1e3:.1f} | " + " | ".join(cells) + " |")
    lines += ["", "model: hidden / layers / query heads / key-value heads / head dim (MLA: nope+rope) of the built config; "
              "(tiny): its scaled model did not build or run, so the census's tiny sizes at this length. "
              "refused: use() raised a UsageError; failed: accepted, then the step failed (messages in results.json)."]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/hf-families"))
    parser.add_argument("--set", dest="sets", nargs="+", default=["tested"], choices=[*SETS, "all"],
                        help="the groups of families (default: tested, the original table families)")
    parser.add_argument("--families", nargs="+", default=None, help="model_types, from any group (instead of --set's)")
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument("--length", type=int, default=1024)
    add_model_arguments(parser, rounds=5)
    parser.add_argument("--steps", type=int, default=3, help="steps timed per method and round (the fastest kept)")
    parser.add_argument("--resume", action="store_true", help="keep the families of --out's results.json measured with the same settings")
    args = parsed(parser, "hf", "the untouched model, the reference of every ratio")
    import torch
    import transformers

    from posenc.bench.machine import cpu_model
    from posenc.files import check_writable, write_json, write_text

    transformers.logging.set_verbosity_error()
    _tests_modules()
    known = groups(args.sets if args.families is None else SETS[:-1])  # (--families: the census group not enumerated)
    families = list(known) if args.families is None else list(dict.fromkeys(args.families))
    group = {f: group_of(f, known) if args.families else known[f] for f in families}
    check_writable(args.out / "results.json")  # before any family is built
    data: dict[str, Any] = {"families": {}, "times_s": {}, "refused": {}, "failed": {}, "skipped": {}}
    old = args.out / "results.json"
    if args.resume and old.exists():
        saved = json.loads(old.read_text())
        if saved.get("settings") == settings(args):
            for key in data:
                data[key].update(saved.get(key, {}))
        else:
            print(f"--resume: {old} was measured with other settings; starting afresh", file=sys.stderr)

    def save() -> None:
        write_json(old, {"command": " ".join(["python", "benchmarks/hf_families.py", *sys.argv[1:]]), "cpu": cpu_model(),
                         "torch": torch.__version__, "transformers": transformers.__version__, "settings": settings(args), **data})

    for family in families:
        if any(family in data[k] for k in ("times_s", "failed", "skipped")):
            continue
        start = time.perf_counter()
        try:
            found, left, sizes, scale, tried = runners(family, group[family], args)
        except NoRope as why:
            data["skipped"][family] = str(why)
            save()
            continue
        except Exception as error:
            data["failed"][family] = f"{type(error).__name__}: {error}"[:600]
            print(f"{family}: not measured ({data['failed'][family][:200]})", file=sys.stderr, flush=True)
            save()
            continue
        built = time.perf_counter() - start
        methods = [m for m in args.methods if m in found]
        times: dict[str, list[float]] = {m: [] for m in methods}
        for r in range(args.rounds):
            for method in rotated(methods, r):
                times[method].append(min(found[method].step() for _ in range(args.steps)))
        del found
        data["times_s"][family] = times
        data["refused"][family] = left
        data["families"][family] = {"group": group[family], "sizes": sizes, "scale": scale, "tried": tried, "build_s": round(built, 2),
                                    "timed_s": round(time.perf_counter() - start - built, 2)}
        print(f"{family} ({sizes}, {scale}; {built:.1f} s build, {data['families'][family]['timed_s']:.1f} s timed): "
              + ", ".join(f"{m} {statistics.median([t / b for t, b in zip(times[m], times['hf'])]):.2f}x" for m in methods)
              + "".join(f", {m} {why.split(':')[0]}" for m, why in left.items()), file=sys.stderr, flush=True)
        save()
    text = table(args, families, data)
    print(text)
    write_text(args.out / "table.md", text)
    save()


if __name__ == "__main__":
    main()
