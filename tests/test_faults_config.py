"""Faults in checkpoints, configs, schedules and argument checking (issue 34: defects 3, 4, 8, 9,
10, 13, 15, 16, 17), found by trying them as a new user would. Each case asserts the exact
message or the result; results are checked against transformers' own classes or a float64
reference written here."""

from __future__ import annotations

import math
import re

import pytest
import torch

import posenc
import posenc.hf
from posenc.encodings.query_scale import LogFloorScale, ScalableSoftmax, Temperature
from posenc.errors import UsageError
from posenc.model.schedule import Layer, Schedule

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


def raises(message: str):
    return pytest.raises(UsageError, match=f"^{re.escape(message)}$")


def qkv(t: int = 5, heads: int = 2, d: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(1, heads, t, d), torch.randn(1, heads, t, d), torch.randn(1, heads, t, d)


# -- 3: save_checkpoint(model, "x.json") ------------------------------------------------------------


def test_3_a_checkpoint_path_other_than_the_weights_file_is_refused(tmp_path) -> None:
    model = posenc.LM(posenc.LMConfig(dim=16, num_heads=2, depth=1, vocab_size=32))
    for name in ("x.json", "x", "x.pt"):
        with raises(f"path: give the weights file NAME.safetensors (its json NAME.json is written beside it), "
                    f"got {str(tmp_path / name)!r}"):
            posenc.save_checkpoint(model, tmp_path / name)
    assert list(tmp_path.iterdir()) == []  # nothing written
    mine = tmp_path / "config.json"
    mine.write_text('{"mine": 1}')
    with raises(f"path: {mine} exists and is not a posenc checkpoint's json; refusing to replace it "
                "(choose another NAME.safetensors, or move the file)"):
        posenc.save_checkpoint(model, tmp_path / "config.safetensors")
    assert mine.read_text() == '{"mine": 1}' and not (tmp_path / "config.safetensors").exists()
    # The weights file and its json: saved twice (a rerun), loaded back with the same weights.
    path = tmp_path / "m.safetensors"
    posenc.save_checkpoint(model, path)
    posenc.save_checkpoint(model, path)
    back = posenc.load_checkpoint(path)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values()))


# -- 4 and 8: posenc.hf checkpoints ---------------------------------------------------------------


def _llama(kv_heads: int = 2) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=kv_heads)
    return transformers.LlamaForCausalLM(config).eval()


PLAIN_LOAD = ("LlamaAttention 0: attn_implementation='posenc' needs posenc.hf.use(model, encoding) first "
              "(a model saved after use: load it with posenc.hf.from_pretrained)")


@pytest.mark.parametrize("method", ["nope", "alibi", "sinusoidal", "sandwich", "xpos", "axial_rope", "t5"])
def test_4_a_plain_load_of_a_posenc_checkpoint_fails(method, tmp_path, monkeypatch) -> None:
    """Before: the model's own RoPE, without a word, for every method without weights."""
    torch.manual_seed(0)
    model = posenc.hf.use(_llama(), method)
    model.save_pretrained(tmp_path)
    assert transformers.AutoConfig.from_pretrained(tmp_path)._attn_implementation == "posenc"
    ids = torch.randint(0, 64, (1, 9))
    # posenc's attention registered (this process used posenc.hf): the model builds, its first forward stops
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    with raises(PLAIN_LOAD):
        plain(ids)
    # a process that never imported posenc.hf: transformers refuses to build it
    monkeypatch.delitem(transformers.AttentionInterface._global_mapping, "posenc")
    with pytest.raises(ValueError, match=re.escape('Specified `attn_implementation="posenc"` is not supported')):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    monkeypatch.undo()
    # the way it loads: the same logits as the saved model
    back = posenc.hf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, rtol=0, atol=1e-6)
    # the model's own attention, asked for in writing: the model's own RoPE
    own = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    assert type(own.model.rotary_emb).__name__ == "LlamaRotaryEmbedding"


def test_8_rope_mixed_with_grouped_query_heads_reloads(tmp_path) -> None:
    """Before: a size mismatch (frequencies (2, 2, 4) saved, (2, 4, 4) rebuilt) and a RuntimeError."""
    torch.manual_seed(0)
    model = posenc.hf.use(_llama(kv_heads=2), "rope_mixed")
    with torch.no_grad():
        model.model.posenc_encodings[0].frequencies.add_(0.1)  # trained away from the initialisation
    model.save_pretrained(tmp_path)
    back = posenc.hf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path)
    assert back.model.posenc_encodings[0].num_kv_heads == 2
    assert torch.equal(back.model.posenc_encodings[0].frequencies, model.model.posenc_encodings[0].frequencies)
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, rtol=0, atol=1e-6)


# -- 9: Schedule.to_text ----------------------------------------------------------------------------


def test_9_to_text_round_trips_every_option_exactly() -> None:
    """Before: max_distance=10000 was written '1e4', read back as 10000.0 and refused by T5."""
    s = Schedule.of([{"encoding": "t5", "options": {"max_distance": 10000, "num_buckets": 32}},
                     {"encoding": "rope", "options": {"base": 10000.0, "scaling": {"rope_type": "linear", "factor": 8.0}}},
                     {"encoding": "xpos", "options": {"scale_base": 512.0, "block_size": 20000}}])
    text = s.to_text()
    assert text == ("1x[t5:max_distance=10000,num_buckets=32] 1x[rope:base=1e4,scaling=linear(factor=8.0)] "
                    "1x[xpos:scale_base=512.0,block_size=20000]")
    again = Schedule.parse(text)
    for a, b in zip(again.layers, s.layers):
        assert a.options == b.options
        assert [type(v) for v in a.options.values()] == [type(v) for v in b.options.values()]
    assert again.layers[1].options["scaling"] == {"rope_type": "linear", "factor": 8.0}
    model = posenc.LM(posenc.LMConfig(dim=16, num_heads=2, depth=3, vocab_size=32, schedule=text))
    assert model.blocks[0].attn.encoding.max_distance == 10000
    for value in (12345.0, 1.5e4, 0.1, 1e-7, 2**60, -3, 1.2345678901234567e19):
        layer = Schedule.parse(Schedule.of([{"encoding": "rope", "options": {"base": value}}]).to_text()).layers[0]
        assert layer.options["base"] == value and type(layer.options["base"]) is type(value)
    for scale in (Temperature(0.123456789, 8192), LogFloorScale(0.1, 16384), ScalableSoftmax(0.43)):
        assert Schedule.parse(f"[{Layer('nope', query_scale=scale).to_text()}]").layers[0].query_scale == scale
    with raises("schedule: option value '10' cannot be written in the text form (it would read back as another "
                "value); only the json form (to_list) can hold it"):
        Layer("rope", {"layout": "10"}).to_text()


# -- 10: mrope_from_hf and the raw Qwen2-VL config.json ---------------------------------------------


def raw(**changes) -> dict:
    """A Qwen2-VL config.json as published (a fresh dict: transformers' config class edits the block)."""
    return {"model_type": "qwen2_vl", "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
            "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]}, **changes}


def test_10_mrope_from_hf_reads_the_published_qwen2_vl_form() -> None:
    """Before: rope_type 'mrope' refused; without rope_theta the base was 10000, not 1e6."""
    from posenc.encodings.mrope import DEFAULT_THETA, mrope_from_hf

    transformers.logging.set_verbosity_error()
    hf = transformers.Qwen2VLConfig(**raw())
    ours = mrope_from_hf(raw())
    assert ours.base == hf.text_config.rope_parameters["rope_theta"] == 1e6
    assert ours.mrope_section == hf.text_config.rope_parameters["mrope_section"] == [4, 6, 6]
    assert (ours.base, ours.mrope_section, ours.head_dim) == (mrope_from_hf(hf).base, mrope_from_hf(hf).mrope_section, 32)
    for cls in (transformers.Qwen2VLTextConfig, transformers.Qwen2_5_VLTextConfig, transformers.Qwen3VLTextConfig):
        assert DEFAULT_THETA[cls.model_type] == cls.default_theta
        outer = cls.model_type.removesuffix("_text")
        assert DEFAULT_THETA[outer] == cls.default_theta
    given = mrope_from_hf(raw(rope_theta=5e4))
    assert given.base == transformers.Qwen2VLConfig(**raw(rope_theta=5e4)).text_config.rope_parameters["rope_theta"]
    with raises("mrope_from_hf: the config gives no rope_theta and model_type 'other' has no known default (known: "
                f"{sorted(DEFAULT_THETA)}); give rope_theta"):
        mrope_from_hf(raw(model_type="other"))


# -- 13: an absolute encoding with a schedule ---------------------------------------------------------


def test_13_an_absolute_encoding_with_a_schedule_is_refused() -> None:
    """Before: encoding='sinusoidal' became 'rope' and the input embedding was dropped."""
    for method in ("sinusoidal", "learned"):
        with raises(f"encoding={method!r} is an absolute method (it adds to the token embeddings), and a schedule "
                    "gives every layer's encoding: the two do not combine; drop encoding, or the schedule"):
            posenc.LMConfig(encoding=method, schedule="[rope]", depth=1, dim=16, num_heads=2)
    assert posenc.LMConfig(schedule="[rope]", depth=1, dim=16, num_heads=2).encoding == "rope"


# -- 15: wrong-typed arguments ------------------------------------------------------------------------


def test_15_wrong_types_are_usage_errors() -> None:
    q, k, v = qkv()
    rope = posenc.build("rope", num_heads=2, head_dim=8)
    with raises("positions must be an integer tensor of shape (5,) or (1, 5), got list"):
        posenc.attend(q, k, v, rope, positions=[0, 1, 2, 3, 4])
    for scale in ("temp", 0.5, 2):
        with raises("query_scale must be None or a posenc.encodings.query_scale scale (Temperature, LogFloorScale or "
                    f"ScalableSoftmax, e.g. Temperature(0.1, 8192)), got {type(scale).__name__} {scale!r}"):
            posenc.attend(q, k, v, rope, query_scale=scale)
    with raises("query_scale must be None or a posenc.encodings.query_scale scale (Temperature, LogFloorScale or "
                "ScalableSoftmax, e.g. Temperature(0.1, 8192)), got str 'temp'"):
        posenc.Attention(16, 2, rope, query_scale="temp")
    with raises("schedule: the options of layer 'rope' must be a dict of KEY: VALUE, got list [1, 2]"):
        Schedule.of([{"encoding": "rope", "options": [1, 2]}])
    fox = posenc.build("fox", num_heads=2, head_dim=8)
    with raises("x: fox's forget gates read the layer input, a float (batch, length, dim) tensor with "
                "dim = num_heads * head_dim = 16, got shape (1, 5, 7) of float32"):
        fox.log_gates(torch.randn(1, 5, 7))


def test_15_deberta_v1_is_named_as_unsupported() -> None:
    config = transformers.DebertaConfig(vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                        intermediate_size=64, relative_attention=True, pos_att_type=["c2p", "p2c"],
                                        max_relative_positions=16)
    with raises("encoder: a DeBERTa-v2/v3 encoder has separate query_proj, key_proj and value_proj; this "
                "DebertaEncoder's DisentangledSelfAttention (module transformers.models.deberta.modeling_deberta) has "
                "none (DeBERTa v1 projects q, k and v with one in_proj and is not supported)"):
        posenc.hf.deberta_from_hf(transformers.DebertaModel(config))


def _rotated(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """float64 RoPE, half layout (RoFormer eq. 34 with HF's rotate_half pairing), as reference."""
    d = x.shape[-1]
    inv_freq = (1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)).double()  # float32 frequencies
    angles = positions.double()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
    x = x.double()
    half = torch.cat((-x[..., d // 2:], x[..., : d // 2]), -1)
    return x * cos + half * sin


@pytest.mark.parametrize("method", ["rope", "mrope", "axial_rope"])
def test_15_positions_near_1e9_allocate_no_table_of_1e9(method) -> None:
    """Before: RoPE's table grew to the largest position (8 GB of float64 angles at 1e9)."""
    from posenc.encodings.rope import table_rows

    q, k, v = qkv()
    enc = posenc.build(method, num_heads=2, head_dim=8)
    positions = torch.arange(5) + 10**9
    out = posenc.attend(q, k, v, enc, positions=positions)
    assert out.shape == (1, 2, 5, 8) and bool(out.isfinite().all())
    table = enc._main if method == "rope" else enc._table
    assert table.length <= table_rows(table.inv_freq.numel())
    if method == "rope":  # the result: RoPE at those positions, as a float64 reference computes it
        qr, kr = _rotated(q, positions, 10000.0), _rotated(k, positions, 10000.0)
        logits = (qr @ kr.transpose(-1, -2) / math.sqrt(8)).masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), -math.inf)
        torch.testing.assert_close(out.double(), logits.softmax(-1) @ v.double(), rtol=0, atol=1e-5)


def test_15_a_table_asked_for_past_its_bound_names_cache_length() -> None:
    with raises("cache_length: a cos/sin table of 4 frequencies holds at most 2,796,202 positions (256 MiB), got "
                "1,000,000,000; larger positions are computed when they come, without a table"):
        posenc.build("rope", num_heads=2, head_dim=8, cache_length=10**9)


# -- 16: lenient input ----------------------------------------------------------------------------------


def test_16_gates_need_an_encoding_with_gates_and_must_be_log_gates() -> None:
    """Before: RoPE with gates ran as a decayed RoPE; positive and NaN gates ran."""
    q, k, v = qkv()
    gates = -torch.rand(1, 2, 5)
    for name, label in (("rope", "RoPE"), ("nope", "NoPE")):
        with raises(f"log_gates: encoding {label} has no forget gates (the Gates hook); gates would change its scores, "
                    "so leave log_gates None (for NoPE with gates computed elsewhere, pass a fox encoding: attend reads "
                    "only the gates given)"):
            posenc.attend(q, k, v, posenc.build(name, num_heads=2, head_dim=8), log_gates=gates)
    fox = posenc.build("fox", num_heads=2, head_dim=8)
    with raises("log_gates are log forget gates, each finite and <= 0 (log sigmoid), got up to 0.5"):
        posenc.attend(q, k, v, fox, log_gates=gates.clamp(max=-0.1).index_fill(-1, torch.tensor([2]), 0.5))
    with raises("log_gates are log forget gates, each finite and <= 0 (log sigmoid), got NaN"):
        posenc.attend(q, k, v, fox, log_gates=gates.index_fill(-1, torch.tensor([1]), math.nan))
    with raises("log_gates are log forget gates, each finite and <= 0 (log sigmoid), got -inf"):
        posenc.attend(q, k, v, fox, log_gates=gates.index_fill(-1, torch.tensor([1]), -math.inf))
    assert posenc.attend(q, k, v, fox, log_gates=gates.index_fill(-1, torch.tensor([1]), 0.0)).isfinite().all()


def test_16_a_key_given_twice_in_a_schedule_is_refused() -> None:
    """Before: the last one won."""
    cases = {
        "[rope window=4 window=8]": "schedule: [rope window=4 window=8]: 'window' is given twice; a layer takes each key once",
        "[rope:base=10 base=100]": "schedule: [rope:base=10 base=100]: 'base' is given twice; a layer takes each key once",
        "[rope:base=10,base=100]": "schedule: [rope:base=10,base=100]: 'base' is given twice; a layer takes each key once",
        "[rope sinks sinks]": "schedule: [rope sinks sinks]: 'sinks' is given twice; a layer takes each key once",
        "[nope temp=0.1/8192 ssmax=0.4]": "schedule: [nope temp=0.1/8192 ssmax=0.4]: one query scale per layer (temp, beta or ssmax)",
        "[rope scaling=linear(factor=2;factor=4)]":
            "schedule: 'linear(factor=2;factor=4)': 'factor' is given twice; a block takes each key once",
    }
    for text, message in cases.items():
        with raises(message):
            Schedule.parse(text)


def test_16_numeric_texts_in_hf_configs_are_refused() -> None:
    from posenc.encodings.mrope import mrope_from_hf

    with raises("mrope_from_hf: rope_theta must be a number > 1, got '1e6'"):
        mrope_from_hf(raw(rope_theta="1e6"))
    with raises("mrope_from_hf: num_attention_heads must be a positive integer, got '2'"):
        mrope_from_hf(raw(num_attention_heads="2"))
    with raises("mrope_from_hf: head_dim must be a positive integer, got '32'"):
        mrope_from_hf(raw(head_dim="32"))
    with raises("rope_from_hf: rope_theta must be a number in (1, 1e+12], got '500000'"):
        posenc.rope_from_hf({"num_attention_heads": 2, "hidden_size": 32, "rope_theta": "500000"})


# -- 17: the xPos refusal's advice ----------------------------------------------------------------------


def test_17_the_xpos_refusal_advises_what_is_not_in_effect() -> None:
    """Before: 'use a larger scale_base, centre=True, or float32' with centre=True and float32 in effect."""
    from posenc.encodings.xpos import XPos

    def refusal(enc: XPos, dtype: torch.dtype, last: int) -> str:
        q, k = torch.randn(1, 1, 1, 8, dtype=dtype), torch.randn(1, 1, 2, 8, dtype=dtype)
        with pytest.raises(UsageError) as err:
            enc.rotate(q, k, torch.tensor([last]), torch.tensor([0, last]))
        return str(err.value)

    assert refusal(XPos(1, 8), torch.float32, 40000) == (
        "xpos: positions 0..40000 (centre 20001) with scale_base=512 need decay factors up to e^49, beyond what "
        "float32 holds; use scale_base >= 565 (centre=True and float32's range are already in effect)")
    assert refusal(XPos(1, 8, centre=False), torch.float32, 20000).endswith("use scale_base >= 565, or centre=True")
    assert refusal(XPos(1, 8), torch.float16, 6000).endswith("use scale_base >= 679, or float32 inputs")
    # the advice holds: the scale_base it names runs, one below it does not
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 2, 8)
    XPos(1, 8, scale_base=565).rotate(q, k, torch.tensor([40000]), torch.tensor([0, 40000]))
    with pytest.raises(UsageError):
        XPos(1, 8, scale_base=564).rotate(q, k, torch.tensor([40000]), torch.tensor([0, 40000]))


def test_the_hf_config_readers_need_no_transformers() -> None:
    # transformers made unimportable: posenc.hf and its config readers import, its model names refuse
    import subprocess
    import sys

    code = """
import sys
sys.modules["transformers"] = None
import posenc, posenc.hf
config = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
          "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}
assert posenc.schedule_from_hf(config).to_text()
assert posenc.rope_from_hf(config).scaling.rope_type == "linear"
try:
    posenc.hf.use
except ImportError as error:
    assert "pip install 'posenc[hf]'" in str(error), error
else:
    raise AssertionError("posenc.hf.use without transformers")
assert sys.modules["transformers"] is None
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
