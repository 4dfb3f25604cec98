"""``use(model, "rope", **options)`` keeps the model's own RoPE where the options do not speak: each
layer's base, the family's NoPE layers (issue 48, items 2 and 26), and a dynamic block without the
training length reads the config's, as transformers does. FoX's gate takes the model's hidden size,
and FoX runs with the family's windows, chunks and sinks (tests/hf/test_fox_families.py: each layer
against the formula)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
import posenc.hf as phf  # noqa: E402
from posenc.encodings.rope import RoPE  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_families import err, logits, tokens, untouched  # noqa: E402


def scaled_copy(model, block: dict):
    """The untouched model with ``block`` as its own rope_parameters (transformers' own scaling)."""
    config = copy.deepcopy(model.config)
    config.rope_parameters = block
    theirs = transformers.AutoModelForCausalLM.from_config(config).eval()
    theirs.load_state_dict(model.state_dict(), strict=False)
    return theirs


def test_a_scaling_keeps_the_models_base_and_nope_layers() -> None:
    ref = untouched("smollm3")  # NoPE on every fourth layer, base 2e6
    base = ref.config.rope_parameters["rope_theta"]
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16}
    model = phf.use(copy.deepcopy(ref), "rope", scaling=yarn)
    encodings = [e for e in phf.adapter._installed(model)]
    ropes = [e for e in encodings if isinstance(e, RoPE)]
    assert ropes and all(e.base == base for e in ropes)
    assert any(not isinstance(e, RoPE) for e in encodings)  # the NoPE layers stay NoPE
    theirs = scaled_copy(ref, {**yarn, "rope_theta": base})
    ids = tokens(1, 40)
    assert err(logits(model, ids), logits(theirs, ids)) < 1e-5


def test_a_dynamic_block_without_the_training_length_reads_the_configs() -> None:
    ref = untouched("llama")
    block = {"rope_type": "dynamic", "factor": 3.0}
    model = phf.use(copy.deepcopy(ref), "rope", scaling=block)
    theirs = scaled_copy(ref, {**block, "rope_theta": ref.config.rope_parameters["rope_theta"]})
    ids = tokens(1, ref.config.max_position_embeddings + 20)  # past the training length: the base grows
    assert err(logits(model, ids), logits(theirs, ids)) < 1e-4


@pytest.mark.parametrize("kind", ["yarn", "longrope"])
def test_llama4s_norm_after_the_rotation_cancels_the_attention_factor(kind: str) -> None:
    """Llama 4 normalises q and k (weightless RMS) after its rotation, which cancels a YaRN or LongRoPE
    attention factor; posenc rotates after that norm, so it drops the factor (it applied it: 0.03).
    What remains is the norm's eps acting on the scaled vectors (rms_norm_eps 1e-5)."""
    ref = untouched("llama4_text")
    assert ref.config.use_qk_norm
    half = ref.config.head_dim // 2
    block = ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16} if kind == "yarn" else
             {"rope_type": "longrope", "factor": 2.0, "original_max_position_embeddings": 16, "short_factor": [1.0] * half,
              "long_factor": [2.0] * half})
    model = phf.use(copy.deepcopy(ref), "rope", scaling=block)
    theirs = scaled_copy(ref, {**block, "rope_theta": ref.config.rope_parameters["rope_theta"]})
    ids = tokens(1, 40)
    assert err(logits(model, ids), logits(theirs, ids)) < 1e-4
    unnormed = copy.deepcopy(ref.config)
    unnormed.use_qk_norm = False  # without the norm the factor stays (the 128-expert model)
    plain = transformers.AutoModelForCausalLM.from_config(unnormed).eval()
    plain.load_state_dict(ref.state_dict(), strict=False)
    model = phf.use(copy.deepcopy(plain), "rope", scaling=block)
    assert err(logits(model, ids), logits(scaled_copy(plain, {**block, "rope_theta": ref.config.rope_parameters["rope_theta"]}), ids)) < 1e-5


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen3_moe", "gpt_neox", "mistral", "gpt_oss", "llama4_text"])
def test_fox_runs_where_the_hidden_size_differs_and_with_windows_chunks_and_sinks(model_type: str) -> None:
    """FoX's gate reads the layer input (config.hidden_size wide, not heads x head_dim in MLA models or
    Qwen3), and runs with the family's windows (Mistral, gpt-oss), sinks (gpt-oss) and chunks (Llama 4):
    cached greedy decoding past them equals the full pass (issue 47, item 7)."""
    ref = untouched(model_type)
    model = phf.use(ref, "fox")
    gates = [e for e in phf.adapter._installed(model)]
    assert all(e.input_dim == ref.config.hidden_size for e in gates)
    ids = tokens(1, 14)
    out = model.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    full = logits(model, out.sequences, use_cache=False)[0]
    for step, step_logits in enumerate(out.logits):
        assert err(step_logits[0], full[13 + step]) < 1e-4
