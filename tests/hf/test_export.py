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
