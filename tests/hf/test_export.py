"""posenc.hf.export: a plain transformers checkpoint, loaded without posenc, gives posenc's logits."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import posenc.hf as ph  # noqa: E402
from posenc.errors import UsageError  # noqa: E402

T = 16
BLOCKS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": T},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": T},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "original_max_position_embeddings": T, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0},
    "longrope": {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": T,
                 "short_factor": [1.0] * 4, "long_factor": [1.0, 1.5, 2.0, 4.0]},
}


def rope_llama(rope_parameters: dict | None = None) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    extra = {"rope_parameters": {**rope_parameters, "rope_theta": 10000.0}} if rope_parameters else {}
    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, vocab_size=256, max_position_embeddings=T, **extra)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("kind", list(BLOCKS))
@pytest.mark.parametrize("from_config", [True, False])
def test_exported_checkpoint_loads_in_plain_transformers_with_the_same_logits(kind, from_config, tmp_path):
    block = BLOCKS[kind]
    if from_config:  # the model's own RoPE, with the scaling in its config
        model = ph.use(rope_llama(block), "rope")
    else:  # a plain model, posenc's RoPE given the scaling
        model = ph.use(rope_llama(), "rope", scaling=block) if block else ph.use(rope_llama(), "rope", base=10000.0)
    ids = torch.randint(0, 256, (2, 3 * T))  # past the training length: every scaling acts
    with torch.no_grad():
        ours = model(ids).logits
    ph.export(model, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert not [k for k in config if "posenc" in k] and "_attn_implementation" not in config
    assert config["rope_parameters"]["rope_type"] == kind
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert plain.config._attn_implementation != ph.NAME
    with torch.no_grad():
        theirs = plain(ids).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)


@pytest.mark.parametrize("encoding, options, named", [("alibi", {}, "alibi"), ("nope", {}, "nope"),
                                                      ("rope", {"scaling": {"rope_type": "ntk", "factor": 2.0}}, "ntk"),
                                                      ("rope", {"layout": "interleaved"}, "interleaved")])
def test_what_transformers_cannot_express_is_refused_by_name(encoding, options, named, tmp_path):
    model = ph.use(rope_llama(), encoding, **options)
    with pytest.raises(UsageError, match=named):
        ph.export(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_never_writes_into_a_folder_of_other_files(tmp_path):
    (tmp_path / "mine.txt").write_text("keep")
    with pytest.raises(UsageError, match="path"):
        ph.export(ph.use(rope_llama(), "rope"), tmp_path)
    assert (tmp_path / "mine.txt").read_text() == "keep"


@pytest.mark.parametrize("model_type", ["phi", "cohere", "qwen2", "gpt_neox"])
def test_export_in_other_families(model_type, tmp_path):
    """Partial rotary (Phi, GPT-NeoX: the family's own rotated width) and interleaved pairs (Cohere)
    export as the family's transformers code expresses them; YaRN given to posenc."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/, where hf_family_configs.py is
    from hf_family_configs import config_kwargs

    config = transformers.AutoConfig.for_model(model_type, **config_kwargs(model_type))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    own = ph.use(model, "rope")
    enc = own.model.posenc_encodings[0] if hasattr(own, "model") else own.gpt_neox.posenc_encodings[0]
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16}
    ph.use(model, "rope", base=enc.base, scaling=yarn)
    ids = torch.randint(3, 64, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
    out = ph.export(model, tmp_path / "plain")
    saved = json.loads((out / "config.json").read_text())
    assert "posenc" not in saved and saved["rope_parameters"]["rope_type"] == "yarn"
    plain = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert (plain(ids).logits - expected).abs().max() < 1e-5


def family_model(model_type: str, **sizes) -> transformers.PreTrainedModel:
    """A tiny model of ``model_type`` (tests/hf_family_configs.py), seeded."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from hf_family_configs import config_kwargs

    config = transformers.AutoConfig.for_model(model_type, **config_kwargs(model_type, **sizes))
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def exported_difference(model, path) -> float:
    """The largest logit difference between ``model`` and its export, loaded in plain transformers."""
    ids = torch.randint(3, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids).logits
    plain = transformers.AutoModelForCausalLM.from_pretrained(ph.export(model, path)).eval()
    assert plain.config._attn_implementation != ph.NAME
    with torch.no_grad():
        return float((plain(ids).logits - ours).abs().max())


@pytest.mark.parametrize("model_type, schedule, named", [
    ("llama", "[rope window=8]", "window=8"),
    ("llama", "[rope chunk=8]", "chunk=8"),
    ("llama", "[rope temp=0.5/4]", "temp"),
    ("llama", "3x[rope] 1x[rope window=4]", "layer 3"),
    ("mistral", "[rope window=4] [rope]", "layer 0 attends with window=4"),  # windowed and full layers: its config has one kind
    ("cohere2", "[rope]", "window=8"),  # drops the family's windows
    ("smollm3", "[rope]", "nope"),  # rotates the family's NoPE layer
    ("llama4_text", "[rope chunk=8]", "nope"),
])
def test_export_refuses_layers_the_family_config_cannot_say(model_type, schedule, named, tmp_path):
    """Windows, chunks, query temperatures and NoPE layers live in the layer plans, not in the
    encodings: an export of them as the family's plain config ran another model (0.2 to 2 in the
    logits, issue 48 items 1 and 2); it is refused, naming the layer's attention."""
    model = ph.use(family_model(model_type), schedule)
    with pytest.raises(UsageError, match=named):
        ph.export(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model_type, scaling", [
    ("smollm3", {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16}),
    ("cohere2", {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16}),
    ("llama4_text", {"rope_type": "linear", "factor": 2.0}),
    ("mistral", {"rope_type": "linear", "factor": 2.0}),
])
def test_export_keeps_the_family_layer_pattern(model_type, scaling, tmp_path):
    """use(model, "rope", scaling=...) keeps the family's NoPE layers, windows and chunks; the export
    writes them as the family's config does and loads with posenc's logits (it was refused, naming
    the NoPE layers' 'nope', issue 48 item 2)."""
    model = ph.use(family_model(model_type), "rope", scaling=scaling)
    assert exported_difference(model, tmp_path / "out") < 1e-5


def test_export_writes_a_window_the_family_config_can_say(tmp_path):
    """Mistral with posenc's window of 4 where its config says 8: one window on every layer, which
    its config's sliding_window says (exported as 8 before: 0.43 in the logits, issue 48 item 1)."""
    model = ph.use(family_model("mistral"), "[rope window=4]")
    assert exported_difference(model, tmp_path / "out") < 1e-5
    assert json.loads((tmp_path / "out" / "config.json").read_text())["sliding_window"] == 4


def test_export_checks_the_block_against_the_family_config_class(tmp_path):
    """Phi-3's config class keeps only default and longrope (it turns yarn into a longrope block
    without factors: a raw KeyError before); Ministral 3 keeps its llama_4_scaling_beta (lost
    before: the export failed at its first forward). Issue 48 item 13."""
    for scaling in ({"rope_type": "linear", "factor": 2.0},
                    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16}):
        model = ph.use(family_model("phi3"), "rope", scaling=scaling)
        with pytest.raises(UsageError, match="Phi3Config .*keeps rope types default, longrope"):
            ph.export(model, tmp_path / scaling["rope_type"])
    model = ph.use(family_model("ministral3"), "rope")
    assert exported_difference(model, tmp_path / "ministral3") < 1e-5
    saved = json.loads((tmp_path / "ministral3" / "config.json").read_text())
    assert saved["rope_parameters"]["llama_4_scaling_beta"] == model.config.rope_parameters["llama_4_scaling_beta"]
    # A scaling whose length differs from the one Ministral 3's query scale divides by: the plain model
    # would scale queries otherwise, so it is refused.
    model = ph.use(family_model("ministral3"), "rope", scaling={"rope_type": "yarn", "factor": 2.0,
                                                               "original_max_position_embeddings": 16})
    with pytest.raises(UsageError, match="query scale"):
        ph.export(model, tmp_path / "ministral3-yarn")


def test_a_dynamic_export_warns_that_it_is_for_transformers_only(tmp_path):
    """vLLM serves a dynamic block with unscaled frequencies (NaN past the original length, issue 48
    item 11): the export warns; the other scalings do not."""
    model = ph.use(rope_llama(), "rope", scaling=BLOCKS["dynamic"])
    with pytest.warns(UserWarning, match="vLLM"):
        ph.export(model, tmp_path / "dynamic")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ph.export(ph.use(rope_llama(), "rope", scaling=BLOCKS["yarn"]), tmp_path / "yarn")


def test_every_public_name_stays_itself_after_its_module_is_imported() -> None:
    """A public name of posenc.hf is never shadowed by a submodule of the same name: in a fresh
    interpreter, importing every module of the package first (as a user's `from posenc.hf.<module>
    import ...` does) leaves each public name the function or class it names (posenc.hf.export was
    then a module, not callable)."""
    import os
    import subprocess
    import sys

    code = ("import importlib, pkgutil, types, posenc.hf as ph\n"
            "for info in pkgutil.iter_modules(ph.__path__):\n"
            "    importlib.import_module('posenc.hf.' + info.name)\n"
            "bad = [n for n in ph.__all__ if isinstance(getattr(ph, n), types.ModuleType)]\n"
            "assert not bad, bad\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ.copy())
    assert done.returncode == 0, done.stderr[-2000:]
