"""Faults found by trying ``rope_from_hf``, RoPE scalings and ``posenc show rope --scaling`` with
real and extreme Hugging Face configs: each is a UsageError with the exact message below, and the
keys are resolved as the installed ``transformers`` resolves them (tested against it)."""

from __future__ import annotations

import copy
import json
import re
import warnings

import pytest
import torch

import posenc
from posenc import cli
from posenc.errors import UsageError
from posenc.hf.rope_config import resolve_hf

transformers = pytest.importorskip("transformers")

SIZES = {"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 2048}
S = {"rope_type": "linear", "factor": 2.0}
P = {"rope_type": "linear", "factor": 4.0, "rope_theta": 5000.0}


def raises(message: str):
    return pytest.raises(UsageError, match=f"^{re.escape(message)}$")


def fails(capsys, argv: list[str], message: str) -> None:
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err == f"posenc {argv[0]}: error: {message}\n"
    assert captured.out == ""


def hf_block(d: dict) -> dict:
    transformers.logging.set_verbosity_error()
    return dict(transformers.LlamaConfig(**copy.deepcopy(d)).rope_parameters)


# ---- rope_scaling vs rope_parameters: as transformers reads them --------------------------------


COMBINATIONS = {
    "scaling only": {"rope_scaling": S},
    "parameters only": {"rope_parameters": P},
    "both": {"rope_scaling": S, "rope_parameters": P},
    "empty scaling, parameters": {"rope_scaling": {}, "rope_parameters": P},
    "null scaling, parameters": {"rope_scaling": None, "rope_parameters": P},
    "scaling, empty parameters": {"rope_scaling": S, "rope_parameters": {}},
    "top-level theta, parameters": {"rope_theta": 77.0, "rope_parameters": P},
    "top-level theta, scaling": {"rope_theta": 77.0, "rope_scaling": S},
    "top-level theta only": {"rope_theta": 77.0},
    "neither": {},
    "old type key": {"rope_scaling": {"type": "linear", "factor": 2.0}},
    "partial rotary at both levels": {"partial_rotary_factor": 0.5, "rope_scaling": {**S, "partial_rotary_factor": 0.25}},
    "yarn, no original length": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
    "yarn with its original length": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}},
}


@pytest.mark.parametrize("name", list(COMBINATIONS))
def test_the_block_and_its_keys_are_what_transformers_reads(name: str) -> None:
    d = {**SIZES, **COMBINATIONS[name]}
    want = hf_block(d)
    got = resolve_hf(d)
    theirs = {k: v for k, v in want.items() if k not in ("rope_theta", "type", "rope_type")}
    ours = {k: v for k, v in got.scaling.items() if k not in ("type", "rope_type")}
    assert ours == theirs
    assert got.base == want["rope_theta"]
    assert got.scaling.get("rope_type", got.scaling.get("type", "default")) == want["rope_type"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        enc = posenc.rope_from_hf(d)
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(transformers.LlamaConfig(**copy.deepcopy(d)))
    torch.testing.assert_close(enc.inv_freq, rotary.inv_freq.float(), rtol=1e-6, atol=0)


def test_which_key_won_is_said(tmp_path, capsys) -> None:
    d = {**SIZES, "rope_scaling": S, "rope_parameters": P}
    with pytest.warns(UserWarning, match=re.escape(
            "rope_from_hf: the config has both rope_scaling and rope_parameters; read the rope_scaling block "
            "(rope_parameters ignored, as transformers does)")):
        enc = posenc.rope_from_hf(d)
    assert enc.hf_source == "rope_scaling" and enc.base == 10000.0
    assert posenc.rope_from_hf({**SIZES, "rope_parameters": P}).hf_source == "rope_parameters"
    assert posenc.rope_from_hf(SIZES).hf_source is None
    # show --scaling and rope_from_hf read one file the same way (one resolver).
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    assert cli.main(["show", "rope", "--scaling", str(path), "--out", str(tmp_path / "s.png")]) == 0
    assert capsys.readouterr().out == (
        "rope: wavelength per pair, original vs scaled, from the rope_scaling block (rope_parameters ignored, "
        f"as transformers does) -> {tmp_path / 's.png'}\n")


def test_original_length_at_both_levels_is_refused_when_they_differ() -> None:
    d = {**SIZES, "original_max_position_embeddings": 512,
         "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}}
    with raises("rope_from_hf: original_max_position_embeddings is 512 at the top level and 1024 in rope_scaling; "
                "transformers' config classes disagree on which wins (LlamaConfig: the block's, Phi3Config: the "
                "top level's), so give one"):
        posenc.rope_from_hf(d)
    d["original_max_position_embeddings"] = 1024  # equal: fine
    assert posenc.rope_from_hf(d).scaling.original_max_position_embeddings == 1024


# ---- extreme values: finite tables or a UsageError with the range --------------------------------


@pytest.mark.parametrize("block,message", [
    ({"rope_type": "dynamic", "factor": 1e16, "original_max_position_embeddings": 64},
     "rope scaling: factor must be a finite number in [0.0001, 1e+06], got 1e+16"),
    ({"rope_type": "linear", "factor": 1e-40}, "rope scaling: factor must be a finite number in [0.0001, 1e+06], got 1e-40"),
    ({"rope_type": "linear", "factor": 1e308}, "rope scaling: factor must be a finite number in [0.0001, 1e+06], got 1e+308"),
    ({"rope_type": "ntk", "factor": 1e300}, "rope scaling: factor must be a finite number in [0.0001, 1e+06], got 1e+300"),
    ({"rope_type": "linear", "factor": float("nan")}, "rope scaling: factor must be a finite number in [0.0001, 1e+06], got nan"),
    ({"rope_type": "linear", "factor": 2.0, "rope_theta": float("inf")},
     "rope scaling: rope_theta must be a finite number in (1, 1e+12], got inf"),
    ({"rope_type": "longrope", "short_factor": [1e-40] * 8, "long_factor": [1.0] * 8, "original_max_position_embeddings": 64,
      "factor": 2.0}, "rope scaling: short_factor[0] must be a finite number in [0.0001, 1e+06], got 1e-40"),
])
def test_extreme_scaling_values_are_refused_with_the_range(block, message) -> None:
    with raises(message):
        posenc.build("rope", num_heads=2, head_dim=16, scaling=block)


@pytest.mark.parametrize("base", [float("inf"), float("nan"), 1e400, 1e13, 1.0, -5.0])
def test_base_must_be_finite_and_in_range(base) -> None:
    with raises(f"base must be a finite number in (1, 1e+12], got {base!r}"):
        posenc.build("rope", num_heads=2, head_dim=16, base=base)


@pytest.mark.parametrize("factor", [1e-4, 0.5, 2.0, 1e6])
@pytest.mark.parametrize("rope_type", ["linear", "ntk", "dynamic"])
def test_the_whole_accepted_range_gives_finite_rotating_tables(rope_type, factor) -> None:
    block = {"rope_type": rope_type, "factor": factor}
    if rope_type == "dynamic":
        block["original_max_position_embeddings"] = 64
    for base in (1.0001, 1e12):
        enc = posenc.build("rope", num_heads=1, head_dim=4, base=base, scaling=block, cache_length=8)
        for length in (8, 64, 128):
            cos, sin = enc.cos_sin(torch.arange(length), length)
            assert torch.isfinite(cos).all() and torch.isfinite(sin).all()
            assert (enc.frequencies(length) > 0).all()


def test_dynamic_at_the_training_length_is_plain_rope_for_any_factor() -> None:
    # Before: s*l/L - (s-1) cancelled to 0 for s = 1e16, and the base became 0 (NaN tables).
    plain = posenc.build("rope", num_heads=1, head_dim=16)
    enc = posenc.build("rope", num_heads=1, head_dim=16, scaling={"rope_type": "dynamic", "factor": 1e6,
                                                                 "original_max_position_embeddings": 64})
    torch.testing.assert_close(enc.frequencies(64), plain.inv_freq, rtol=0, atol=0)


# ---- 9, 10. silent coercions, tracebacks ------------------------------------------------------------


@pytest.mark.parametrize("config,message", [
    ({"hidden_size": 512, "num_attention_heads": 3.5}, "rope_from_hf: num_attention_heads must be a positive integer, got 3.5"),
    ({"hidden_size": 512, "num_attention_heads": 0}, "rope_from_hf: num_attention_heads must be a positive integer, got 0"),
    ({"hidden_size": 512, "num_attention_heads": "8"}, "rope_from_hf: num_attention_heads must be a positive integer, got '8'"),
    ({"hidden_size": 512, "num_attention_heads": 3},
     "rope_from_hf: hidden_size (512) must be a multiple of num_attention_heads (3) when the config gives no head_dim"),
    ({"hidden_size": "512", "num_attention_heads": 8}, "rope_from_hf: hidden_size must be a positive integer, got '512'"),
    ({"head_dim": 64.9, "num_attention_heads": 8}, "rope_from_hf: head_dim must be a positive integer, got 64.9"),
    ({**SIZES, "rope_theta": 0}, "rope_from_hf: rope_theta must be a number in (1, 1e+12], got 0"),
    ({**SIZES, "rope_theta": "500000"}, "rope_from_hf: rope_theta must be a number in (1, 1e+12], got '500000'"),
    ({**SIZES, "rope_theta": float("inf")}, "rope_from_hf: rope_theta must be a number in (1, 1e+12], got inf"),
    ({**SIZES, "max_position_embeddings": "2048", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "rope_from_hf: max_position_embeddings must be a positive integer, got '2048'"),
    ({**SIZES, "rope_scaling": {"rope_type": ["linear"], "factor": 2.0}},
     "rope scaling: rope_type must be one of ['default', 'linear', 'ntk', 'dynamic', 'yarn', 'llama3', 'longrope', "
     "'proportional', 'ntk_alpha', 'resonance'], got ['linear']"),
    ({**SIZES, "rope_scaling": "linear"}, "rope_from_hf: rope_scaling must be a JSON object (a dict of RoPE keys), got 'linear'"),
    ({**SIZES, "rope_scaling": {"rope_type": "ntk", "factor": "2"}},
     "rope scaling: factor must be a finite number in [0.0001, 1e+06], got '2'"),
    ({**SIZES, "head_dim": 2, "rope_scaling": {"rope_type": "ntk", "factor": 2.0}},
     "rope scaling: ntk raises the base to the power r/(r-2) of the rotated features r: it needs rotary_dim >= 4, got 2"),
    ({**SIZES, "head_dim": 2, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "rope scaling: dynamic raises the base to the power r/(r-2) of the rotated features r: it needs rotary_dim >= 4, got 2"),
    ({**SIZES, "rope_scaling": {"rope_type": "ntk", "factor": 1e300}},
     "rope scaling: factor must be a finite number in [0.0001, 1e+06], got 1e+300"),
])
def test_rope_from_hf_refuses_instead_of_coercing(config, message) -> None:
    with raises(message):
        posenc.rope_from_hf(config)


def test_valid_neighbours_are_accepted() -> None:
    assert posenc.rope_from_hf({"hidden_size": 512, "num_attention_heads": 4}).head_dim == 128
    assert posenc.rope_from_hf({"head_dim": 64, "num_attention_heads": 8, "rope_theta": 500000}).base == 500000.0
    assert posenc.rope_from_hf({**SIZES, "head_dim": 4, "rope_scaling": {"rope_type": "ntk", "factor": 2.0}}).rotary_dim == 4


# ---- show --scaling reads any config rope_from_hf reads, the same way -----------------------------


CONFIGS = {
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "ntk": {"rope_scaling": {"rope_type": "ntk", "factor": 4.0}},
    "proportional": {"rope_parameters": {"rope_type": "proportional", "partial_rotary_factor": 0.25}},
    "llama3 without original length": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0}},
    "dynamic": {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_show_scaling_reads_hf_configs(tmp_path, capsys, monkeypatch, name) -> None:
    from posenc.show import scaling as rope_plot

    d = {"hidden_size": 384, "num_attention_heads": 4, "max_position_embeddings": 1024, "rope_theta": 500000.0,
         "partial_rotary_factor": 0.5 if name != "proportional" else None, **CONFIGS[name]}
    d = {k: v for k, v in d.items() if v is not None}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    drawn = {}
    real = rope_plot.scaling_figure

    def spy(scaling, head_dim=64, base=None, rotary_dim=None, **kw):
        drawn.update(scaling=scaling, head_dim=head_dim, base=base)
        return real(scaling, head_dim, base=base, rotary_dim=rotary_dim, **kw)

    from posenc.show import scores as show_scores

    monkeypatch.setattr(show_scores, "scaling_figure", spy)  # the name `posenc show --scaling` calls
    assert cli.main(["show", "rope", "--scaling", str(path), "--out", str(tmp_path / "s.png")]) == 0
    capsys.readouterr()
    enc = posenc.rope_from_hf(d)
    assert drawn["head_dim"] == enc.head_dim == 96 and drawn["base"] == enc.base
    from posenc.encodings.rope import RoPE
    assert RoPE(1, drawn["head_dim"], base=drawn["base"], scaling=drawn["scaling"]).rotary_dim == enc.rotary_dim


def test_show_scaling_messages(tmp_path, capsys) -> None:
    missing = tmp_path / "nope.json"
    fails(capsys, ["show", "rope", "--scaling", str(missing), "--out", str(tmp_path / "a.png")],
          f"scaling: no file {str(missing)!r} (give a JSON object such as '{{\"rope_type\": \"yarn\", \"factor\": 4, "
          "\"original_max_position_embeddings\": 2048}', or the path of a model's config.json)")
    fails(capsys, ["show", "rope", "--scaling", '{"rope_type": "ntk", "factor": 1e300}', "--out", str(tmp_path / "a.png")],
          "rope scaling: factor must be a finite number in [0.0001, 1e+06], got 1e+300")
    fails(capsys, ["show", "rope", "--scaling", '{"rope_type": "dynamic", "factor": 1e300, "original_max_position_embeddings": 8}',
                   "--out", str(tmp_path / "a.png")], "rope scaling: factor must be a finite number in [0.0001, 1e+06], got 1e+300")
    path = tmp_path / "c.json"
    path.write_text(json.dumps({**SIZES, "rope_scaling": S}))
    fails(capsys, ["show", "rope", "--scaling", str(path), "--head-dim", "32", "--out", str(tmp_path / "a.png")],
          "head_dim: the config gives head_dim 16, not 32; leave out head_dim")
    assert cli.main(["show", "rope", "--scaling", str(path), "--head-dim", "16", "--out", str(tmp_path / "a.png")]) == 0
