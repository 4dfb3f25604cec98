"""A training step of the families posenc.hf covers inside ``transformers``: the untouched model
against ``posenc.hf.use(model, m)`` for m in rope (the model's own schedule), alibi and t5.

    PYTHONPATH=src:tests python benchmarks/hf_families.py --out benchmarks/results/hf-families
    PYTHONPATH=src:tests python benchmarks/hf_families.py --set all --resume --out benchmarks/results/hf-families-all

``--set`` picks the groups (several may be given; ``--families`` names model types instead, from any
group), each built with the tests' own builders and config tables, not copies of them:

- ``tested`` (the default): the original table families (tests/hf_family_configs.py's ``TESTED``),
  built from their tiny test config scaled up: hidden 256, 4 layers, 8 query heads, 4 key/value heads
  (MLA: 8), head dim 32, windows and chunks at a quarter of the length, vocab 256.
- ``rows``: the family rows of issue 47 (tests/hf/test_family_rows.py: ``ROWS``, every row the census
  builds, nanochat), ``mrope``: the M-RoPE text backbones (tests/hf/test_mrope_backbones.py),
  ``hybrids``: the attention + state-space / linear-attention families (tests/hf/test_hybrid_families.py),
  ``encoders``: the masked-LM encoders with a row or a named refusal (tests/hf/test_census_encoders.py),
  ``census``: every causal-LM type and text backbone the census (tests/hf_census_configs.py) builds
  that may rotate, ``all``: every group. These are built from the census's tiny config with its
  sizes raised to the same scaled ones (the census's ``TINY`` keys, its per-family ``OVERRIDES`` on
  top, so an override's own head dim or layer list stands; one layer of each kind repeated to 4
  layers unless the override fixes the layers; M-RoPE sections refitted to the head in the
  override's proportions, or split evenly where posenc cannot interleave those: Qwen3-VL). A family
  whose scaled model does not build or run, or is refused under "rope" where its tiny one is not,
  keeps the census's tiny sizes, at the benchmark's length (positions and windows scaled). The
  table's ``model`` column gives the sizes each family ran at, read from its built config; results.json
  says what was tried before (``tried``).

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
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hf_step import add_model_arguments, parsed, rotated, timed_step  # (benchmarks/, this script's folder)

METHODS = ["hf", "rope", "alibi", "t5"]
SETS = ["tested", "rows", "mrope", "hybrids", "encoders", "census"]
PRIORITY = ["tested", "mrope", "hybrids", "encoders", "rows", "census"]  # a type named by several groups is in the first
TESTS = Path(__file__).resolve().parents[1] / "tests"
#: override keys that fix a family's layers: the census's layer count is kept for it
LAYER_KEYS = ("num_hidden_layers", "layer_types", "layer_rope_theta", "attn_layer_indices", "per_layer_config", "layers_block_type",
              "block_types", "num_kv_shared_layers", "rope_scaling_layers", "mlp_only_layers", "kv_source_layers", "index_layers",
              "mlp_layer_types")


def _tests_modules() -> None:
    """tests/ and tests/hf on the import path (the builders and config tables live there)."""
    for path in (TESTS, TESTS / "hf"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))


def groups(names: list[str]) -> dict[str, str]:
    """model_type -> its group, for the groups ``names`` (``all``: every one), each type once (in the
    most specific group naming it: a hybrid with a family row is a hybrid), in the groups' order."""
    _tests_modules()
    chosen = SETS if "all" in names else [s for s in SETS if s in names]
    found: dict[str, str] = {}
    for group in sorted(chosen, key=PRIORITY.index):
        for model_type in _members(group):
            found.setdefault(model_type, group)
    return dict(sorted(found.items(), key=lambda item: SETS.index(item[1])))


def _members(group: str) -> list[str]:
    if group == "tested":
        from hf_family_configs import TESTED

        return list(TESTED)
    if group == "rows":
        import test_family_rows

        from hf_family_configs import TESTED

        rows = [t for t, _ in test_family_rows.ROWS] + test_family_rows._rows() + ["nanochat"]
        return [t for t in dict.fromkeys(rows) if t not in TESTED]  # (the TESTED ones are the tested group)
    if group == "mrope":
        import test_mrope_backbones

        return list(test_mrope_backbones.TYPES)
    if group == "hybrids":
        import test_hybrid_families

        return list(test_hybrid_families.HYBRIDS)
    if group == "encoders":
        import test_census_encoders

        return list(dict.fromkeys(test_census_encoders.ROWED + sorted(test_census_encoders.REASONS)))
    import hf_census_configs as census

    return [c.model_type for c in census.cases() if c.model_type not in census.UNBUILDABLE and census.rotates(c)]


def source(model_type: str, group: str) -> str:
    """How the family is built and trained: "tested" (tests/hf_family_configs.py), "causal-lm",
    "backbone" (its bare model) or "masked-lm" (an encoder)."""
    from transformers.models.auto import modeling_auto

    if group == "tested":
        return "tested"
    if group == "encoders" or (model_type in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
                               and model_type not in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        return "masked-lm"
    return "causal-lm" if model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else "backbone"


def group_of(model_type: str, known: dict[str, str]) -> str:
    """A ``--families`` name's group: its own where the selected groups name it, else ``tested`` for
    a TESTED type, else the census's (causal LM, backbone or masked LM by its mappings)."""
    from hf_family_configs import TESTED

    if model_type in known:
        return known[model_type]
    return "tested" if model_type in TESTED else "census"


@contextlib.contextmanager
def _tiny(values: dict[str, Any]) -> Iterator[None]:
    """The census's ``TINY`` keys with ``values`` over them, for the duration."""
    import hf_census_configs as census

    saved = dict(census.TINY)
    census.TINY.update(values)
    try:
        yield
    finally:
        census.TINY.clear()
        census.TINY.update(saved)


def _refit_sections(keys: dict[str, Any], default: Any, even: bool) -> None:
    """An M-RoPE block's sections (in frequencies) refitted to the head's rotated half, as the census
    shrinks them to its tiny head: from the family's default sections (``default``, its real
    proportions: Qwen3-VL's interleaved ones need them) where it has some, else the block's own (an
    override's are written for the census's head dim of 16); ``even``: as equal as they go, the first
    axis taking the rest (posenc interleaves Qwen3-VL's sections only while none is too long)."""
    block = keys.get("rope_parameters")
    if not (isinstance(block, dict) and isinstance(block.get("mrope_section"), (list, tuple)) and "hidden_size" in keys):
        return
    factor = block.get("partial_rotary_factor", keys.get("partial_rotary_factor", 1.0)) or 1.0
    head_dim = keys.get("head_dim") or keys["hidden_size"] // keys.get("num_attention_heads", 4)
    own = default if isinstance(default, (list, tuple)) and len(default) == len(block["mrope_section"]) else block["mrope_section"]
    total, sections = int(head_dim * factor) // 2, list(own)
    if even:
        fitted = [total // len(sections)] * len(sections)
        fitted[0] += total - sum(fitted)
    else:
        fitted = [max(1, x * total // sum(sections)) for x in sections]
        fitted[-1] += total - sum(fitted)
    keys["rope_parameters"] = {**block, "mrope_section": fitted}


def census_keys(base: Any, model_type: str | None, own: dict[str, Any], layers: int | None, census_layers: int,
                even: bool = False) -> dict[str, Any]:
    """The census's keys for ``base`` (its TINY as now set, then ``model_type``'s override ``own``, or
    a sub-config's), with one layer of each kind repeated to ``layers``; where ``own`` fixes the layers
    (a layer list, per-layer keys), or ``layers`` is None, the census's layer count stands (one of each
    kind, else ``census_layers``)."""
    import hf_census_configs as census

    keys = census._tiny_keys(base, model_type)
    if model_type is None:
        keys.update(own)
    kinds = keys.get("layer_types")
    if layers is not None and not any(k in own for k in LAYER_KEYS):
        if isinstance(kinds, list) and kinds:
            kinds = list(dict.fromkeys(kinds))
            keys["layer_types"] = [kinds[i % len(kinds)] for i in range(max(layers, len(kinds)))]
            keys["num_hidden_layers"] = len(keys["layer_types"])
    elif "num_hidden_layers" in keys and "num_hidden_layers" not in own:
        keys["num_hidden_layers"] = len(kinds) if isinstance(kinds, list) and kinds else census_layers
    block = getattr(base, "rope_parameters", None)
    _refit_sections(keys, block.get("mrope_section") if isinstance(block, dict) else None, even)
    return keys


def census_model(model_type: str, kind: str, values: dict[str, Any], layers: int | None, even: bool = False) -> Any:
    """The census's model of ``model_type`` (tests/hf_census_configs.py: its config made the census's
    way, every sub-config too) with ``values`` over its tiny sizes, built as ``kind`` (``even``: M-RoPE
    sections split evenly)."""
    import torch
    from transformers import AutoConfig, PretrainedConfig

    import hf_census_configs as census

    census_layers = census.TINY["num_hidden_layers"]
    with _tiny(values):
        base = AutoConfig.for_model(model_type)
        kwargs = census_keys(base, model_type, census.OVERRIDES.get(model_type, {}), layers, census_layers, even)
        for name in getattr(base, "sub_configs", {}) or {}:
            sub = getattr(base, name, None)
            if isinstance(sub, PretrainedConfig):
                kwargs[name] = census_keys(sub, None, census.OVERRIDES.get(f"{model_type}.{name}", {}), layers, census_layers, even)
        config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(0)
    return census.model_class(census.Case(model_type, kind)).from_config(config)


def scaled_values(args: argparse.Namespace) -> dict[str, Any]:
    """The census's size keys at the benchmark's sizes."""
    return dict(vocab_size=256, hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                **length_values(args))


def length_values(args: argparse.Namespace) -> dict[str, Any]:
    """The keys that follow the length: positions, windows and chunks (a quarter of it), Mamba-2's scan chunks."""
    return dict(max_position_embeddings=max(4096, 2 * args.length), sliding_window=args.length // 4,
                attention_chunk_size=args.length // 4, mamba_chunk_size=min(256, max(8, args.length // 4)),
                attention_dropout=0.0, attention_probs_dropout_prob=0.0)  # posenc.hf trains without attention dropout


def tested_model(model_type: str, args: argparse.Namespace) -> Any:
    """tests/hf_family_configs.py's model of a TESTED family, scaled up (as before issue 47)."""
    import torch
    import transformers

    from hf_family_configs import config_kwargs

    sizes = dict(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                 num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                 vocab_size=256, max_position_embeddings=max(4096, 2 * args.length), sliding_window=args.length // 4)
    config = transformers.AutoConfig.for_model(model_type, **config_kwargs(model_type, **sizes))
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


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


def sizes_of(model: Any) -> str:
    """hidden / layers / query heads / key-value heads / head dim of the built model's (text) config."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    hidden = getattr(text, "hidden_size", None)
    try:
        head = getattr(text, "head_dim", None)
    except Exception:  # a per-layer head dim that refuses a global read (Gemma 4): the default, and "per layer"
        head = f"{text.to_dict().get('head_dim')} (per layer)"
    if getattr(text, "qk_rope_head_dim", None):
        head = f"{getattr(text, 'qk_nope_head_dim', 0) or 0}+{text.qk_rope_head_dim}"
    elif head is None and hidden and heads:
        head = hidden // heads
    sections = _sections(model)
    return (f"{hidden} / {getattr(text, 'num_hidden_layers', '?')} / {heads} / {getattr(text, 'num_key_value_heads', heads)} / {head}"
            + (f", sections {'+'.join(map(str, sections))}" if sections else ""))


def _sections(model: Any) -> list[int] | None:
    """The M-RoPE sections of the built model's (text) config, if any."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    block = getattr(text, "rope_parameters", None)
    found = block.get("mrope_section") if isinstance(block, dict) else None
    return list(found) if isinstance(found, (list, tuple)) else None


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
