"""posenc.hf in every family of posenc's table, each against its untouched ``transformers`` model
built from a tiny config with random weights (nothing downloaded).

``use(model, "rope")`` with no options must *be* the untouched model: logits to 1e-5 on a forward
past the family's window, on a left-padded batch and on a packed row (against its documents run one
by one through the untouched model, no cache); greedy ``generate`` gives identical tokens, with a
dynamic and with a static cache. A bias method (ALiBi) keeps the family's windows and sinks and is
checked against invariants: a packed row equals its documents alone, a padded batch its rows alone,
cached decoding the full pass.

:data:`TESTED` is the tests' own list of families; docs/hf.md's family table is generated from it
and the family rows (``python tests/hf/test_families.py`` rewrites it; a test checks it).
"""

from __future__ import annotations

import contextlib
import copy
import re
import sys
from pathlib import Path

import pytest
import torch

import posenc
from posenc.hf.families import FAMILIES, family_of

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

import posenc.hf as phf  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]

if __name__ == "__main__":  # run as a script: the shared configs are in tests/ (pytest: pythonpath)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_family_configs import COMMON, TESTED, VOCAB, config_kwargs, logits, perturbed, tokens  # noqa: E402


def untouched(model_type: str):
    """The family's tiny model with its default attention, every weight moved off its init value
    (so norm weights are not 1 and sinks not 0)."""
    return perturbed(transformers.AutoConfig.for_model(model_type, **config_kwargs(model_type)))


def stand_in(model) -> phf.RotaryStandIn:
    return next(m for m in model.modules() if isinstance(m, phf.RotaryStandIn))


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def padded_reference(ref, model_type: str, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The untouched model's logits of a left-padded batch; for Llama 4 each row alone, padding
    dropped: its own query temperature counts padding slots as positions (posenc.hf.families:
    temperature), posenc's counts from each row's first real token."""
    if not family_of(model_type).temperature:
        return logits(ref, ids, attention_mask=mask)
    out = torch.zeros(*ids.shape, VOCAB)
    for row in range(ids.shape[0]):
        real = mask[row].bool()
        out[row, real] = logits(ref, ids[row: row + 1, real])[0]
    return out


def packed_and_alone(model, ref, lengths=(7, 12, 5)) -> float:
    """A packed row (position_ids restarting) through ``model`` against each document alone through
    ``ref`` with no cache: the largest logit difference."""
    docs = [tokens(1, n, seed=10 + i) for i, n in enumerate(lengths)]
    ids = torch.cat(docs, dim=1)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = logits(model, ids, position_ids=pos, use_cache=False)
    alone = torch.cat([logits(ref, d, use_cache=False) for d in docs], dim=1)
    return err(packed, alone)


@pytest.mark.parametrize("model_type", list(TESTED))
def test_rope_is_the_untouched_model(model_type: str) -> None:
    ref = untouched(model_type)
    model = phf.use(copy.deepcopy(ref), "rope")
    assert not stand_in(model).identity  # the model's own verified RoPE rotates q and k; the cache keeps them rotated
    ids = tokens(2, 20)  # past every window (8) and chunk (8)
    assert err(logits(model, ids), logits(ref, ids)) < 1e-5
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[0, :5] = 0
    real = mask.bool()
    assert err(logits(model, ids, attention_mask=mask)[real], padded_reference(ref, model_type, ids, mask)[real]) < 1e-5
    if not family_of(model_type).no_attention:  # linear-attention layers carry state across documents (HF's own)
        assert packed_and_alone(model, ref) < 1e-5
    for cache in ("dynamic", "static"):
        kwargs = {} if cache == "dynamic" else {"cache_implementation": "static"}
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, **kwargs)
        theirs = ref.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, **kwargs)
        assert torch.equal(ours, theirs), cache


@pytest.mark.parametrize("model_type", list(TESTED))
def test_the_family_schedule_rotated_in_the_attention_is_the_untouched_model(model_type: str) -> None:
    """The model's own schedule given as a schedule: posenc's RoPE rotates inside the attention
    (the family row's layout and rotated slice), the model's rotary is the identity."""
    ref = untouched(model_type)
    schedule = posenc.schedule_from_hf(ref.config)
    model = phf.use(copy.deepcopy(ref), schedule)
    assert stand_in(model).identity
    ids = tokens(2, 20)
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[0, :5] = 0
    real = mask.bool()
    assert err(logits(model, ids, attention_mask=mask)[real], padded_reference(ref, model_type, ids, mask)[real]) < 1e-5
    ours = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(ours, ref.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("model_type", list(TESTED))
def test_a_bias_method_keeps_the_invariants(model_type: str) -> None:
    """ALiBi in the family, its windows and sinks kept: packed == alone, padded == alone, cached
    greedy decoding == the full forward of the generated tokens."""
    model = phf.use(untouched(model_type), "alibi")
    if not family_of(model_type).no_attention:
        assert packed_and_alone(model, model) < 1e-5
    ids = tokens(2, 14)
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[1, :4] = 0
    padded = logits(model, ids, attention_mask=mask)
    assert err(padded[1, 4:], logits(model, ids[1:, 4:])[0]) < 1e-5
    out = model.generate(ids[:1], max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    full = logits(model, out.sequences, use_cache=False)[0]
    for step, step_logits in enumerate(out.logits):
        assert err(step_logits[0], full[13 + step]) < 1e-4


SCALINGS = {
    "phi3": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 8,
             "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.5 + 0.3 * i for i in range(8)]},
    "qwen2": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8},
    "gemma3_text": {"full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
}


@pytest.mark.parametrize("model_type", list(SCALINGS))
def test_scaled_rope_is_the_untouched_model(model_type: str) -> None:
    """LongRoPE (its attention factor; short / long factors by length), YaRN and Gemma 3's scaled
    global layers, past the original length, in a plain forward and greedy decoding."""
    config = transformers.AutoConfig.for_model(model_type, **config_kwargs(model_type))
    config.rope_parameters = copy.deepcopy(SCALINGS[model_type])
    if model_type == "phi3":
        config.original_max_position_embeddings = 8
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config).eval()
    model = phf.use(copy.deepcopy(ref), "rope")
    for n in (6, 20):
        ids = tokens(1, n)
        assert err(logits(model, ids), logits(ref, ids)) < 1e-5, n
    ids = tokens(1, 6)
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), ref.generate(ids, max_new_tokens=6, do_sample=False))


def test_schedules_and_records() -> None:
    """A schedule text in a family with its own schedule: each layer as it says (a RoPE layer without
    a base keeps the model's own); the config records it and from_pretrained restores it."""
    ref = untouched("gemma3_text")
    model = phf.use(copy.deepcopy(ref), "1x[rope window=8] 1x[alibi]")
    plans = [layer.self_attn.__dict__["_posenc_plan"] for layer in model.model.layers]
    assert [type(p.encoding).name for p in plans] == ["rope", "alibi"] * 2
    assert [p.window for p in plans] == [8, None] * 2
    assert plans[0].encoding.base == 10000.0  # the sliding layers' own base, kept
    assert model.config.posenc["schedule"][1]["encoding"] == "alibi"
    rope_only = phf.use(copy.deepcopy(ref), "2x[rope]")  # the model's RoPE without windows: only its window layers differ
    ids = tokens(1, 6)
    assert err(logits(rope_only, ids), logits(ref, ids)) < 1e-5  # within the window, the same model
    with pytest.raises(posenc.UsageError, match="sinks"):
        phf.use(untouched("llama"), "1x[alibi sinks]")
    with pytest.raises(posenc.UsageError, match="depth"):
        phf.use(untouched("llama"), posenc.Schedule.parse("2x[rope]"))


def test_schedule_round_trip(tmp_path) -> None:
    model = phf.use(untouched("gpt_oss"), "1x[alibi window=8 sinks] 1x[t5 sinks]")
    ids = tokens(1, 12)
    expected = logits(model, ids)
    model.save_pretrained(tmp_path)
    loaded = phf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path).eval()
    assert err(logits(loaded, ids), expected) < 1e-6


def test_cache_and_past_key_values_both_work() -> None:
    """transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name accepted, with a
    FutureWarning, until 5.40: posenc and its tests pass ``cache``, and pyproject.toml turns that
    warning into an error; only this check of the old name expects it)."""
    model = phf.use(untouched("mistral"), "t5")
    ids = tokens(1, 12)
    full = logits(model, ids)
    old = tuple(int(v) for v in transformers.__version__.split(".")[:2]) < (5, 40)
    for name in ("cache", "past_key_values") if old else ("cache",):
        with torch.no_grad(), (pytest.warns(FutureWarning, match="past_key_values") if name != "cache" else contextlib.nullcontext()):
            first = model(ids[:, :9], use_cache=True)
            step = model(ids[:, 9:], **{name: first.cache}, use_cache=True).logits
        assert err(step, full[:, 9:]) < 1e-5, name


def test_a_model_outside_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """A family that follows the LLaMA pattern works (arcee: not in the table); one that does not is
    refused naming what differs (nanochat, its row hidden: half pairs turned the other way)."""
    config = transformers.AutoConfig.for_model("arcee", **{k: v for k, v in COMMON.items()})
    ref = transformers.AutoModelForCausalLM.from_config(config).eval()
    assert family_of("arcee") is None
    model = phf.use(copy.deepcopy(ref), "rope")
    ids = tokens(1, 12)
    assert err(logits(model, ids), logits(ref, ids)) < 1e-5
    nanochat = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("nanochat", **COMMON))
    monkeypatch.setattr(phf.adapter, "family_of", lambda model_type: None)
    with pytest.raises(posenc.UsageError, match="not in posenc's family table and its rotation is not LLaMA's"):
        phf.use(nanochat, "rope")  # half pairs turned the other way


# -- docs/hf.md's family table ---------------------------------------------------------------------

DOCS = Path(__file__).resolve().parents[2] / "docs" / "hf.md"
BEGIN, END = "<!-- families: begin (python tests/hf/test_families.py) -->", "<!-- families: end -->"
CHECKS = "forward past the window, left padding, packed row, greedy generate (dynamic and static cache); ALiBi invariants"
HYBRID_CHECKS = ("the census, and tests/hf/test_hybrid_families.py: posenc's attention in the attention layers only, "
                 "the schedule rotated in the attention, ALiBi's cached decoding, packed rows")
INKLING_CHECKS = ('the census, and tests/hf/test_inkling_family.py: use(model, "inkling") is the untouched model (forward, '
                  "left padding, cached decoding, gradients of its own curves); RoPE, ALiBi, NoPE keep its windows and sinks")
ROW_CHECKS = ("the census, and tests/hf/test_family_rows.py: the row's RoPE rotated in posenc's attention (forward past the "
              "window, left padding, cached decoding)")
#: the families of issue 47 item 3 checked by tests/hf/test_family_rows.py
ROWS_TESTED = {"minicpm3", "glm4_moe_lite", "sarvam_mla", "youtu", "axk1", "mistral4", "bailing_hybrid", "ernie4_5", "helium", "glm",
               "cohere2_moe", "afmoe", "exaone4", "flint", "beam", "ergo", "laguna", "mellum", "lfm3", "granite_swa", "muse_spark_text",
               "gemma3n_text", "gemma4_text", "mimo_v2_flash", "nanochat", "molmo2_text",
               "lara_mini", "falcon", "gptj", "codegen", "longcat_flash", "moshi"}
MROPE_CHECKS = ("the census, and tests/hf/test_mrope_backbones.py: 3-axis image rows, left padding, cached decoding; "
                "ALiBi, T5, NoPE at text positions")
#: the M-RoPE rows checked by tests/hf/test_mrope_rows.py (issue 47 item 4: the census's other M-RoPE backbones)
MROPE_ROWS_TESTED = {"cosmos3_edge_text", "cohere_compass_text", "hunyuan_vl_text"}
MROPE_ROW_CHECKS = ("the census, and tests/hf/test_mrope_rows.py: 3- or 4-axis image rows, left padding, cached decoding, "
                    "tables that differ from the config refused; ALiBi at text positions")

#: the rows whose model rotates itself beyond M-RoPE (a learned per-channel weight after the rotation), checked by
#: tests/hf/test_model_rotates.py
MODEL_ROTATES_TESTED = {"hunyuan_v1_dense", "hunyuan_v1_moe", "dory"}
MODEL_ROTATES_CHECKS = ('the census, and tests/hf/test_model_rotates.py: "rope" is the untouched model (forward, left padding, '
                        "cached decoding), tables that differ from the config refused, posenc's rotations refused; ALiBi against "
                        "a reference, ALiBi, T5, NoPE decoding as their full pass")


def family_table() -> str:
    rows = ["| family | model_type | what it needed | tested |", "|---|---|---|---|"]
    for family in FAMILIES:
        tested = [t for t in family.model_types if t in TESTED]
        if not family.causal:
            continue
        hybrid = bool(family.no_attention or family.type_names)
        checks = (CHECKS if tested else ROW_CHECKS if ROWS_TESTED & set(family.model_types)
                  else INKLING_CHECKS if family.own != "rope"
                  else MODEL_ROTATES_CHECKS if MODEL_ROTATES_TESTED & set(family.model_types)
                  else (MROPE_ROW_CHECKS if MROPE_ROWS_TESTED & set(family.model_types) else MROPE_CHECKS) if family.mrope
                  else HYBRID_CHECKS if hybrid
                  else 'the schedule only (tests/hf/test_schedule_config.py)')
        rows.append(f"| {family.name} | {', '.join(f'`{t}`' for t in family.model_types)} | {family.needs} | {checks} |")
    return "\n".join(rows)


def test_docs_family_table_is_generated_from_this_list() -> None:
    text = DOCS.read_text()
    found = re.search(re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END), text, re.S)
    assert found is not None, f"docs/hf.md lacks the {BEGIN} block"
    assert found.group(1) == family_table(), "run: python tests/hf/test_families.py"
    assert all(family_of(t) is not None for t in TESTED)


if __name__ == "__main__":  # rewrite docs/hf.md's table
    text = DOCS.read_text()
    block = f"{BEGIN}\n{family_table()}\n{END}"
    if BEGIN in text:
        text = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    else:
        text += "\n" + block + "\n"
    DOCS.write_text(text)
    sys.exit(0)
