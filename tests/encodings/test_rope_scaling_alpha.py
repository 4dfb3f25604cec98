"""NTK-alpha (Hunyuan) and Resonance RoPE as RoPE scaling blocks.

References:
- NTK-alpha: vLLM's ``DynamicNTKAlphaRotaryEmbedding`` (the rope type vLLM serves Hunyuan with):
  ``base' = base * alpha^(d / (d - 2))``, d the rotary dim, then the default frequencies
  ``base'^(-2k/d)``; written out densely below, and checked live against transformers' Hunyuan
  rotary modules (``compute_ntk_alpha_rope_parameters``, and a Hunyuan checkpoint's
  ``"type": "dynamic"`` block with ``alpha``).
- Resonance RoPE: Wang et al. 2024, "Resonance RoPE: Improving Context Length Generalization of
  Large Language Models", eq. 5 / Algorithm 1: ``theta_i' = 2 pi / round(2 pi / theta_i)``; with
  YaRN (the paper's Resonance YaRN) the rounding follows YaRN's frequency transform, whose frequencies
  are read here from transformers' ``_compute_yarn_parameters``.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

import posenc
from posenc.errors import UsageError
from posenc.study.variants import scaling_block

transformers = pytest.importorskip("transformers")

H, D = 2, 16


def dense_rotation(x: torch.Tensor, positions: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """RoFormer's rotation (Su et al. 2021, eq. 34) in the half layout, pair by pair, float64."""
    out = x.to(torch.float64).clone()
    half = theta.numel()
    for t, p in enumerate(positions.tolist()):
        for k in range(half):
            a = p * float(theta[k])
            x1, x2 = x[..., t, k].double(), x[..., t, k + half].double()
            out[..., t, k] = x1 * math.cos(a) - x2 * math.sin(a)
            out[..., t, k + half] = x2 * math.cos(a) + x1 * math.sin(a)
    return out


def vllm_ntk_alpha(base: float, alpha: float, d: int) -> torch.Tensor:
    """vLLM's NTK-alpha frequencies: base * alpha^(d/(d-2)), then base'^(-2k/d) (float64)."""
    grown = base * alpha ** (d / (d - 2))
    return torch.tensor([grown ** (-2 * k / d) for k in range(d // 2)], dtype=torch.float64)


def resonance(theta: torch.Tensor) -> torch.Tensor:
    """Wang et al. 2024, eq. 5: every wavelength 2 pi / theta rounded to the nearest integer."""
    return torch.tensor([2 * math.pi / round(2 * math.pi / float(t)) for t in theta], dtype=torch.float64)


@pytest.mark.parametrize("alpha,base,rotary_dim", [(4.0, 10000.0, 16), (1000.0, 10000.0, 16), (2.5, 500.0, 8), (1.0, 10000.0, 16)])
def test_ntk_alpha_rotates_as_vllms_formula(alpha: float, base: float, rotary_dim: int) -> None:
    enc = posenc.build("rope", num_heads=H, head_dim=D, base=base, rotary_dim=rotary_dim,
                       scaling={"rope_type": "ntk_alpha", "alpha": alpha})
    theta = vllm_ntk_alpha(base, alpha, rotary_dim)
    torch.testing.assert_close(enc.inv_freq.double(), theta, rtol=1e-6, atol=0)
    torch.manual_seed(0)
    q, k = torch.randn(2, 1, H, 7, D).unbind(0)
    pos = torch.tensor([0, 1, 2, 5, 9, 40, 301])
    qr, kr = enc.rotate(q, k, pos, pos)
    want = dense_rotation(q[..., :rotary_dim], pos, theta.float().double())  # (float32 frequencies, as a checkpoint's)
    torch.testing.assert_close(qr[..., :rotary_dim].double(), want, rtol=0, atol=2e-5)
    assert torch.equal(qr[..., rotary_dim:], q[..., rotary_dim:])  # features past r pass through
    if alpha > 1:  # not plain RoPE: the slowest pair turns slower
        assert enc.inv_freq[-1] < posenc.build("rope", num_heads=H, head_dim=D, base=base, rotary_dim=rotary_dim).inv_freq[-1]


def test_ntk_alpha_equals_transformers_hunyuan_rotary() -> None:
    """Live: a Hunyuan checkpoint's block (``"type": "dynamic"`` with ``alpha`` and the keys it
    carries beside it) through rope_from_hf gives the frequencies and cos/sin of transformers'
    HunYuanDenseV1RotaryEmbedding, and ``ntk_alpha`` spelled directly the same."""
    from transformers.models.hunyuan_v1_dense.configuration_hunyuan_v1_dense import HunYuanDenseV1Config
    from transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense import HunYuanDenseV1RotaryEmbedding

    block = {"type": "dynamic", "alpha": 1000.0, "factor": 1.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
             "mscale_all_dim": 1.0, "rope_theta": 10000.0}
    d = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": D, "max_position_embeddings": 256,
         "rope_scaling": block}
    config = HunYuanDenseV1Config(**json.loads(json.dumps(d)))
    rotary = HunYuanDenseV1RotaryEmbedding(config)
    assert rotary.rope_type == "ntk_alpha"
    enc = posenc.rope_from_hf(d)
    assert enc.scaling.rope_type == "ntk_alpha" and enc.scaling.alpha == 1000.0
    torch.testing.assert_close(enc.inv_freq, rotary.inv_freq.float(), rtol=1e-6, atol=0)
    torch.testing.assert_close(enc.inv_freq.double(), vllm_ntk_alpha(10000.0, 1000.0, D), rtol=1e-6, atol=0)
    direct = posenc.build("rope", num_heads=4, head_dim=D, scaling={"rope_type": "ntk_alpha", "alpha": 1000.0})
    assert torch.equal(direct.inv_freq, enc.inv_freq)
    positions = torch.arange(50)[None]
    cos, sin = rotary(torch.zeros(1, 50, 64), positions)  # (1, T, D): the half layout's cat((f, f))
    ours_cos, ours_sin = enc.cos_sin(positions[0])  # (T, D/2)
    torch.testing.assert_close(ours_cos, cos[0, :, : D // 2], rtol=0, atol=2e-5)
    torch.testing.assert_close(ours_sin, sin[0, :, : D // 2], rtol=0, atol=2e-5)


@pytest.mark.parametrize("alpha", [0.5, 0.0, -2.0, float("inf"), float("nan"), "4", True, 1e7])
def test_an_invalid_alpha_is_refused(alpha: object) -> None:
    with pytest.raises(UsageError, match=r"^rope scaling: alpha must be a finite number in \[1, 1e\+06\], got "):
        posenc.build("rope", num_heads=H, head_dim=D, scaling={"rope_type": "ntk_alpha", "alpha": alpha})


def test_ntk_alpha_needs_alpha_and_only_its_keys() -> None:
    with pytest.raises(UsageError, match=r"needs \['alpha'\]"):
        posenc.build("rope", num_heads=H, head_dim=D, scaling={"rope_type": "ntk_alpha"})
    with pytest.raises(UsageError, match="does not use"):
        posenc.build("rope", num_heads=H, head_dim=D, scaling={"rope_type": "ntk_alpha", "alpha": 2.0, "factor": 2.0})
    with pytest.raises(UsageError, match="rotary_dim >= 4"):
        posenc.build("rope", num_heads=H, head_dim=D, rotary_dim=2, scaling={"rope_type": "ntk_alpha", "alpha": 2.0})


def test_resonance_rounds_every_wavelength_to_an_integer() -> None:
    enc = posenc.build("rope", num_heads=H, head_dim=D, scaling={"rope_type": "resonance"})
    plain = posenc.build("rope", num_heads=H, head_dim=D)
    theta = resonance(plain.inv_freq.double())
    torch.testing.assert_close(enc.inv_freq.double(), theta, rtol=1e-6, atol=0)
    wavelengths = 2 * math.pi / enc.inv_freq.double()
    torch.testing.assert_close(wavelengths, wavelengths.round(), rtol=1e-5, atol=0)
    assert not torch.allclose(enc.inv_freq, plain.inv_freq, rtol=1e-3)  # the rounding moved them
    torch.manual_seed(1)
    q, k = torch.randn(2, 1, H, 6, D).unbind(0)
    pos = torch.tensor([0, 3, 6, 17, 100, 1023])
    qr, _ = enc.rotate(q, k, pos, pos)
    # (the frequencies a checkpoint uses are float32: the dense form rotates with the same rounding)
    torch.testing.assert_close(qr.double(), dense_rotation(q, pos, theta.float().double()), rtol=0, atol=2e-5)
    # The resonance property: each pair's angle repeats after its (integer) wavelength.
    cos, sin = enc.cos_sin(torch.arange(0, 200))
    for kk, lam in enumerate(wavelengths.round().long().tolist()[:3]):  # the wavelengths below 200
        torch.testing.assert_close(cos[lam:, kk], cos[:-lam, kk], rtol=0, atol=1e-4)
        torch.testing.assert_close(sin[lam:, kk], sin[:-lam, kk], rtol=0, atol=1e-4)


@pytest.mark.parametrize("factor,original", [(4.0, 64), (8.0, 128), (2.0, 32)])
def test_resonance_composes_with_yarn_after_its_transform(factor: float, original: int) -> None:
    """Resonance YaRN: transformers' YaRN frequencies (live), then eq. 5's rounding; YaRN's
    attention factor is kept."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    block = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    config = transformers.LlamaConfig(hidden_size=H * D, num_attention_heads=H, max_position_embeddings=original * 4,
                                      rope_parameters={**block, "rope_theta": 10000.0})
    yarn_theta, attention = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    enc = posenc.build("rope", num_heads=H, head_dim=D, scaling={**block, "resonance": True})
    plain_yarn = posenc.build("rope", num_heads=H, head_dim=D, scaling=block)
    torch.testing.assert_close(plain_yarn.inv_freq, yarn_theta.float(), rtol=1e-6, atol=0)
    torch.testing.assert_close(enc.inv_freq.double(), resonance(yarn_theta.double()), rtol=1e-5, atol=0)
    assert enc.attention_factor == pytest.approx(attention)
    # Rounding first and YaRN after is another function: the order matters.
    other = resonance(posenc.build("rope", num_heads=H, head_dim=D).inv_freq.double())
    assert not torch.allclose(enc.inv_freq.double(), other, rtol=1e-4)


def test_resonance_leaves_p_ropes_still_pairs_still_and_refuses_a_zero_wavelength() -> None:
    enc = posenc.build("rope", num_heads=H, head_dim=D, scaling={"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                                               "resonance": True})
    assert (enc.inv_freq[D // 4:] == 0).all() and (enc.inv_freq[: D // 4] > 0).all()
    with pytest.raises(UsageError, match="resonance rounds a wavelength"):
        posenc.build("rope", num_heads=H, head_dim=D, scaling={"rope_type": "linear", "factor": 1e-4, "resonance": True})
    with pytest.raises(UsageError, match="resonance must be true or false"):
        posenc.build("rope", num_heads=H, head_dim=D, scaling={"rope_type": "yarn", "factor": 2.0,
                                                               "original_max_position_embeddings": 32, "resonance": 1})


def test_the_blocks_posenc_extend_and_hf_use_write() -> None:
    """``posenc extend --scaling ntk_alpha|resonance|resonance_yarn`` takes its block from
    scaling_block; ``posenc.hf.use(model, "rope", scaling=...)`` passes a block to RoPE as is."""
    from posenc.extend.extend_config import KINDS

    assert {"ntk_alpha", "resonance", "resonance_yarn"} <= set(KINDS)
    assert scaling_block("ntk_alpha", 4.0, 64, 10000.0, D) == {"rope_type": "ntk_alpha", "alpha": 4.0}
    assert scaling_block("resonance", 4.0, 64, 10000.0, D) == {"rope_type": "resonance"}
    assert scaling_block("resonance_yarn", 4.0, 64, 10000.0, D) == {**scaling_block("yarn", 4.0, 64, 10000.0, D), "resonance": True}
    for kind in ("ntk_alpha", "resonance", "resonance_yarn"):
        posenc.build("rope", num_heads=H, head_dim=D, scaling=scaling_block(kind, 4.0, 64, 10000.0, D))


def test_hf_use_with_ntk_alpha_and_resonance_scalings() -> None:
    """A tiny LLaMA under ``use(model, "rope", scaling=...)`` equals the same model whose own
    rotary module was given those frequencies."""
    from posenc import hf

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
                                      num_hidden_layers=1, vocab_size=50, max_position_embeddings=64)
    original = transformers.LlamaForCausalLM(config).eval()
    tokens = torch.randint(0, 50, (1, 20))
    with torch.no_grad():
        plain = original(tokens).logits
    for block in ({"rope_type": "ntk_alpha", "alpha": 8.0}, {"rope_type": "resonance"}):
        enc = posenc.build("rope", num_heads=2, head_dim=16, scaling=block)
        reference = transformers.LlamaForCausalLM(copy.deepcopy(config)).eval()
        reference.load_state_dict(original.state_dict())
        reference.model.rotary_emb.inv_freq.copy_(enc.inv_freq)
        model = transformers.LlamaForCausalLM(copy.deepcopy(config)).eval()  # (use() writes the config)
        model.load_state_dict(original.state_dict())
        hf.use(model, "rope", scaling=block)
        with torch.no_grad():
            want, got = reference(tokens).logits, model(tokens).logits
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
        assert (got - plain).abs().max() > 1e-4  # the scaling changed the model


@pytest.mark.parametrize("kind", ["ntk_alpha", "resonance_yarn"])
def test_posenc_extend_runs_under_the_new_scalings(kind: str, tmp_path) -> None:
    """``posenc extend --scaling KIND`` on a tiny RoPE checkpoint: its block is recorded and the
    extended checkpoint's RoPE rotates with it."""
    from posenc.cli import main
    from posenc.model.checkpoint import load_checkpoint

    torch.manual_seed(0)
    model = posenc.LM(posenc.LMConfig(encoding="rope", dim=16, depth=1, num_heads=2, vocab_size=256))
    posenc.save_checkpoint(model, tmp_path / "rope.safetensors")
    (tmp_path / "c.txt").write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(300)))
    code = main(["extend", str(tmp_path / "rope.safetensors"), "--out", str(tmp_path / "ext"), "--scaling", kind,
                 "--steps", "1", "--train-length", "16", "--length", "32", "--data", str(tmp_path / "c.txt"),
                 "--valid-bytes", "256", "--batch-size", "2", "--eval-lengths", "16", "32", "--no-progress"])
    assert code == 0
    block = json.loads((tmp_path / "ext" / "extend.json").read_text())["scaling"]
    assert block == scaling_block(kind, 2.0, 16, 10000.0, 8)
    extended = load_checkpoint(tmp_path / "ext" / "model.safetensors")
    enc = next(iter(extended.attentions())).encoding
    assert torch.equal(enc.inv_freq, posenc.build("rope", num_heads=2, head_dim=8, scaling=block).inv_freq)


@pytest.mark.parametrize("block", [{"rope_type": "ntk_alpha", "alpha": 50.0},
                                   {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "resonance": True}])
def test_scores_depend_on_i_minus_j_only(block: dict) -> None:
    """Static frequency schedules: RoPE's relative property holds (scores unchanged by a shift)."""
    enc = posenc.build("rope", num_heads=H, head_dim=D, scaling=block)
    q, k = torch.randn(2, 1, H, 6, D, dtype=torch.float64).unbind(0)
    pos = torch.tensor([0, 2, 3, 7, 11, 40])

    def scores(p: torch.Tensor) -> torch.Tensor:
        qr, kr = enc.rotate(q, k, p, p)
        return qr @ kr.transpose(-1, -2)

    torch.testing.assert_close(scores(pos + 1000), scores(pos), rtol=0, atol=1e-4)
    assert (scores(pos[[0, 1, 2, 3, 5, 4]]) - scores(pos)).abs().max() > 1e-2  # and they do depend on it


def test_export_refuses_the_scalings_transformers_cannot_express() -> None:
    """posenc.hf.export writes transformers' rope_parameters: ntk_alpha and a resonance rounding
    have none (a yarn block's resonance key would be dropped there, silently unrounded)."""
    from posenc.hf.exporting import rope_parameters

    plain = rope_parameters(posenc.build("rope", num_heads=H, head_dim=D, scaling={"rope_type": "linear", "factor": 2.0}), D)
    assert plain["rope_type"] == "linear"
    for block, what in (({"rope_type": "ntk_alpha", "alpha": 4.0}, "has no transformers rope_type"),
                        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "resonance": True},
                         "rounds its wavelengths")):
        with pytest.raises(UsageError, match=what):
            rope_parameters(posenc.build("rope", num_heads=H, head_dim=D, scaling=block), D)


def test_a_hunyuan_model_under_use_with_ntk_alpha_equals_itself() -> None:
    """Live: transformers' HunYuan dense model (its checkpoint's "dynamic" block with alpha). posenc's
    RoPE with ``{"rope_type": "ntk_alpha", "alpha": a}`` has the frequencies of the model's rotary
    module for its own alpha, and others for another; ``posenc.hf.use(model, "rope")`` reads that
    block from the config, verifies it against the module and equals the untouched model, its
    q/k norms' weights moved off 1. A rotation of posenc's own there (the same block given as an
    option) is refused: the model normalises q and k after its rotation with a learned weight."""
    from transformers.models.hunyuan_v1_dense.configuration_hunyuan_v1_dense import HunYuanDenseV1Config
    from transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense import HunYuanDenseV1ForCausalLM

    from posenc import hf

    transformers.logging.set_verbosity_error()
    d = dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             num_hidden_layers=2, vocab_size=64, max_position_embeddings=256,
             rope_scaling={"type": "dynamic", "alpha": 1000.0, "rope_theta": 10000.0, **{"factor": 1.0, "beta_fast": 32,
                                                                                         "beta_slow": 1, "mscale": 1.0}})
    torch.manual_seed(0)
    original = HunYuanDenseV1ForCausalLM(HunYuanDenseV1Config(**copy.deepcopy(d))).eval()
    with torch.no_grad():
        for p in original.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # the q/k norms' weights off 1: a rotation after them would differ
    held = original.model.rotary_emb.inv_freq
    for alpha, same in ((1000.0, True), (10.0, False)):
        ours = posenc.build("rope", num_heads=4, head_dim=16, base=10000.0, scaling={"rope_type": "ntk_alpha", "alpha": alpha})
        assert torch.allclose(ours.inv_freq.float(), held.float(), rtol=1e-5, atol=0) == same, alpha
    ids = torch.randint(0, 64, (2, 40))
    with torch.no_grad():
        want = original(ids).logits
    model = copy.deepcopy(original)
    hf.use(model, "rope")
    with torch.no_grad():
        assert (model(ids).logits - want).abs().max().item() < 1e-5
    with pytest.raises(UsageError, match="after the rotation"):
        hf.use(copy.deepcopy(original), "rope", scaling={"rope_type": "ntk_alpha", "alpha": 1000.0})
