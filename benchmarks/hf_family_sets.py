"""The families benchmarks/hf_families.py times, and how each is built at the benchmark's sizes.

``--set`` picks the groups (several may be given; ``--families`` names model types instead, from any
group), each built with the tests' own builders and config tables, not copies of them:

- ``tested`` (the default): the original table families (tests/hf_family_configs.py's ``TESTED``),
  built from their tiny test config scaled up: hidden 256, 4 layers, 8 query heads, 4 key/value heads
  (MLA: 8), head dim 32, windows and chunks at a quarter of the length, vocab 256.
- ``rows``: the family rows of issue 47 (tests/hf/test_family_rows.py: ``ROWS``, every row the census
  builds, nanochat), ``mrope``: the M-RoPE text backbones (tests/hf/test_mrope_backbones.py, test_mrope_rows.py),
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
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
        import test_mrope_rows

        return list(test_mrope_backbones.TYPES) + [t for t in test_mrope_rows.AXES if "+" not in t]  # a "+" names a variant
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
    axis taking the rest (posenc interleaves Qwen3-VL's sections only while none is too long). A
    block per layer type (Cohere Compass: ``rope_parameters[<layer type>]``) has each refitted."""
    block = keys.get("rope_parameters")
    if not isinstance(block, dict) or "hidden_size" not in keys:
        return
    head_dim = keys.get("head_dim") or keys["hidden_size"] // keys.get("num_attention_heads", 4)
    if isinstance(block.get("mrope_section"), (list, tuple)):
        keys["rope_parameters"] = _refit_block(block, default, even, head_dim, keys.get("partial_rotary_factor", 1.0))
    elif all(isinstance(b, dict) for b in block.values()) and any("mrope_section" in b for b in block.values()):
        keys["rope_parameters"] = {kind: _refit_block(b, None, even, head_dim, keys.get("partial_rotary_factor", 1.0))
                                   if isinstance(b.get("mrope_section"), (list, tuple)) else b for kind, b in block.items()}


def _refit_block(block: dict[str, Any], default: Any, even: bool, head_dim: int, partial: Any) -> dict[str, Any]:
    """One block of :func:`_refit_sections`."""
    factor = block.get("partial_rotary_factor", partial) or 1.0
    own = default if isinstance(default, (list, tuple)) and len(default) == len(block["mrope_section"]) else block["mrope_section"]
    total, sections = int(head_dim * factor) // 2, list(own)
    if even:
        fitted = [total // len(sections)] * len(sections)
        fitted[0] += total - sum(fitted)
    else:
        fitted = [max(1, x * total // sum(sections)) for x in sections]
        fitted[-1] += total - sum(fitted)
    return {**block, "mrope_section": fitted}


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
    """The M-RoPE sections of the built model's (text) config, if any (a block per layer type: the
    first block's)."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    block = getattr(text, "rope_parameters", None)
    if isinstance(block, dict) and "mrope_section" not in block:
        block = next((b for b in block.values() if isinstance(b, dict) and "mrope_section" in b), None)
    found = block.get("mrope_section") if isinstance(block, dict) else None
    return list(found) if isinstance(found, (list, tuple)) else None
