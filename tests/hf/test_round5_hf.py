"""posenc.hf, issue 48: what a plain transformers load of a posenc checkpoint says, what cached
decoding under dynamic NTK does (against transformers' own), and caches with windows and chunks
under posenc's encodings (against the full pass of each row alone)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import posenc.hf as ph  # noqa: E402
from hf_family_configs import tokens  # noqa: E402 (tests/hf_family_configs.py: the ids and logits every hf test uses)

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64


def llama(layers: int = 2, rope_parameters: dict | None = None, max_positions: int = 16) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                                      pad_token_id=0, rope_parameters=rope_parameters or {"rope_type": "default",
                                                                                           "rope_theta": 10000.0})
    return transformers.LlamaForCausalLM(config).eval()


# -- item 9: a plain load of a parameter-free encoding's checkpoint says posenc ---------------------


@pytest.fixture
def transformers_warnings():
    """transformers' warnings on (other test modules set its verbosity to errors when imported)."""
    before = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()
    yield
    transformers.logging.set_verbosity(before)


@pytest.mark.usefixtures("transformers_warnings")
@pytest.mark.parametrize("method", ["sandwich", "alibi", "nope"])
def test_a_plain_load_of_a_parameter_free_checkpoint_names_posenc(method, tmp_path, caplog):
    """Asked for its own attention (``attn_implementation="sdpa"``), plain transformers built the
    model with the family's RoPE without a word (issue 48 item 9): posenc's marker buffer, saved with
    the weights, is now reported UNEXPECTED by name; posenc's own load reports nothing."""
    model = ph.use(llama(), method)
    ids = tokens(1, 12)
    with torch.no_grad():
        expected = model(ids).logits
    model.save_pretrained(tmp_path)
    caplog.clear()
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    said = caplog.text
    assert "posenc_marker" in said and "UNEXPECTED" in said
    assert not hasattr(plain.model, "posenc_marker")
    caplog.clear()
    loaded = ph.from_pretrained(transformers.AutoModelForCausalLM, tmp_path).eval()
    said = caplog.text
    assert "posenc_marker" not in said and "MISSING" not in said and "UNEXPECTED" not in said
    with torch.no_grad():
        assert float((loaded(ids).logits - expected).abs().max()) < 1e-6
    # An export leaves the marker out: its plain load reports nothing.
    out = ph.export(ph.use(llama(), "rope"), tmp_path / "export")
    caplog.clear()
    transformers.AutoModelForCausalLM.from_pretrained(out)
    assert "posenc_marker" not in caplog.text


@pytest.mark.usefixtures("transformers_warnings")
def test_a_checkpoint_saved_before_the_marker_loads_in_posenc_without_a_report(tmp_path, caplog):
    """A posenc checkpoint written before the marker existed (no ``posenc_marker`` weight) loads
    through posenc.hf.from_pretrained without a MISSING report."""
    from safetensors.torch import load_file, save_file

    model = ph.use(llama(), "alibi")
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    assert weights.pop("model.posenc_marker").item() == 1
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    caplog.clear()
    loaded = ph.from_pretrained(transformers.AutoModelForCausalLM, tmp_path)
    assert "MISSING" not in caplog.text
    assert int(loaded.model.posenc_marker) == 1


# -- items 4 and 5: caches of windowed and chunked layers ------------------------------------------


def family_model(model_type: str, encoding: str, **options) -> transformers.PreTrainedModel:
    """A tiny model of ``model_type`` (tests/hf_family_configs.py: a window or chunk of 8) after
    posenc.hf.use(model, encoding, **options)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from hf_family_configs import config_kwargs

    config = transformers.AutoConfig.for_model(model_type, **config_kwargs(model_type))
    torch.manual_seed(0)
    return ph.use(transformers.AutoModelForCausalLM.from_config(config).eval(), encoding, **options)


YARN = {"scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16}}


@pytest.mark.parametrize("model_type, encoding, options", [
    ("mistral", "t5", {}), ("mistral", "alibi", {}), ("mistral", "rope", YARN), ("mistral", "rope", {}),
    ("mixtral", "alibi", {}), ("phi3", "t5", {}), ("ministral3", "rope", YARN),
])
def test_static_cache_of_a_windowed_family_decodes_each_row_as_alone(model_type, encoding, options):
    """A left-padded batch decoded with a static cache past the window (8): generate hands the mask
    posenc's mask function made back to the model, which sliced it again at the sliding layer's
    offset, so a full window's last key was dropped (0.19 to 0.42 a step, issue 48 item 4). Each
    step's logits now equal a full pass of its row alone, without padding or cache."""
    model = family_model(model_type, encoding, **options)
    ids = tokens(2, 6)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :3] = 0
    steps = 12  # row 0 reaches 6 + 12 + 3 padding slots: past the window of 8 in every cache slot
    out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0, cache_implementation="static")
    cached = torch.stack(out.logits, 1)  # (B, steps, V)
    worst = 0.0
    with torch.no_grad():
        for b in range(2):
            row = out.sequences[b, 6 - int(mask[b].sum()):]
            for s in range(steps):
                n = int(mask[b].sum()) + s
                alone = model(row[None, :n], use_cache=False).logits[0, -1]
                worst = max(worst, float((cached[b, s] - alone).abs().max()))
    assert worst < 1e-4


@pytest.mark.parametrize("encoding", ["alibi", "t5", "rope"])
def test_llama4_chunked_decoding_without_position_ids_equals_the_full_pass(encoding):
    """Llama 4 does not pass position_ids to its attention; a cached call given none counted the
    query positions from the keys its chunked layers' cache held (the last chunk - 1), wrong once
    the prompt filled a chunk: 0.38 in the logits (issue 48 item 5). The model's own positions (made
    for its rotary module) are now read; token by token and several tokens at once both equal a
    full pass."""
    model = family_model("llama4_text", encoding)
    seq = tokens(1, 20, seed=2)
    prompt = 9  # past the chunk of 8
    with torch.no_grad():
        full = model(seq, use_cache=False).logits[:, prompt:]
        cache = model(seq[:, :prompt], use_cache=True).cache
        steps = [model(seq[:, t: t + 1], cache=cache, use_cache=True).logits for t in range(prompt, 20)]
        assert float((torch.cat(steps, 1) - full).abs().max()) < 1e-5
        cache = model(seq[:, :prompt], use_cache=True).cache
        together = model(seq[:, prompt:], cache=cache, use_cache=True).logits
        assert float((together - full).abs().max()) < 1e-5


# -- item 8: dynamic NTK while decoding ------------------------------------------------------------


DYNAMIC = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}


def cached_and_full(model, prompt: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy cached decoding's logits at each step (B, steps, V), and the same tokens' logits from
    a full pass over each prefix, without a cache."""
    out = model.generate(prompt, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=0)
    cached = torch.stack(out.logits, 1)
    with torch.no_grad():
        full = torch.stack([model(out.sequences[:, :t], use_cache=False).logits[:, -1]
                            for t in range(prompt.shape[1], out.sequences.shape[1])], 1)
    return cached, full


def test_dynamic_ntk_decoding_is_what_docs_say():
    """Dynamic NTK makes every position's result depend on the current length. posenc keeps keys
    un-rotated in the cache and rotates all of them at the current length's frequencies, so with one
    layer a cached step equals the full pass of its prefix; transformers keeps keys rotated at the
    length they came with, so its own cached decoding differs from its full pass even then. With
    more layers, the deeper layers' cached keys come from hidden states computed at earlier lengths,
    and no KV cache is exact: posenc's and transformers' cached decoding both differ from the full
    pass past the original length (docs/hf.md says this; it said posenc stayed exact, issue 48
    item 8). Before the original length (16) everything agrees."""
    prompt = tokens(1, 8)
    gaps = {}
    for layers in (1, 2):
        ref = llama(layers, DYNAMIC)
        ours = ph.use(copy.deepcopy(ref), "rope")
        for name, model in (("transformers", ref), ("posenc", ours)):
            cached, full = cached_and_full(model, prompt, 16)
            gap = (cached - full).abs().amax(dim=(0, 2))  # (steps,)
            assert float(gap[:8].max()) < 1e-6, (name, layers)  # lengths 9 .. 16: no scaling yet
            gaps[name, layers] = float(gap[8:].max())
    assert gaps["posenc", 1] < 1e-6  # every key rotated at the current length
    assert gaps["transformers", 1] > 1e-5  # keys rotated at older lengths
    assert gaps["posenc", 2] > 1e-6 and gaps["transformers", 2] > 1e-5  # no cache is exact with depth
    # posenc's plain forward is transformers' (the dynamic block read from the config).
    ids = tokens(1, 40)
    ref, ours = llama(2, DYNAMIC), ph.use(llama(2, DYNAMIC), "rope")
    with torch.no_grad():
        assert float((ours(ids).logits - ref(ids).logits).abs().max()) < 1e-5


def test_the_docs_no_longer_claim_dynamic_decoding_is_exact():
    from pathlib import Path

    text = " ".join((Path(__file__).parents[2] / "docs" / "hf.md").read_text().split())
    assert "dynamic NTK stay exact while decoding" not in text
    assert "no KV cache is exact" in text


def test_saved_config_keeps_the_record(tmp_path):
    """The marker is a weight, not a config key: config.json still records the encoding."""
    ph.use(llama(), "sandwich").save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["posenc"]["encoding"] == "sandwich" and saved["attn_implementation"] == ph.NAME


def test_a_state_dict_saved_before_the_marker_loads_strict():
    """A study checkpoint written before the marker (no posenc_marker tensor) still loads with a
    strict load_state_dict, as a study's resume does."""
    model = ph.use(llama(), "alibi")
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("posenc_marker")}
    assert len(state) == len(model.state_dict()) - 1
    fresh = ph.use(llama(), "alibi")
    fresh.load_state_dict(state)  # strict
    assert int(fresh.model.posenc_marker) == 1
