"""XD-RoPE (Hunyuan-VL's four-axis RoPE): live against transformers' ``HunYuanVLRotaryEmbedding``
and Hunyuan-VL's ``apply_rotary_pos_emb`` (tiny random configs, nothing downloaded), its text ids
as RoPE, through ``posenc.attend`` with (4, B, T) ids, cached decoding, errors."""

from __future__ import annotations

import pytest
import torch

import agreement
import posenc
from agreement import check_backends
from posenc.encodings.xdrope import XDRoPE
from posenc.errors import UsageError
from posenc.hf.rope_config import xdrope_from_hf
from posenc.model.cache import LayerCache

transformers = pytest.importorskip("transformers")

from transformers.models.hunyuan_vl import modeling_hunyuan_vl as hvl  # noqa: E402
from transformers.models.hunyuan_vl.configuration_hunyuan_vl import HunYuanVLTextConfig  # noqa: E402

HUNYUAN_KEYS = {"factor": 1.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def hf_config(section: list[int], head_dim: int = 32, alpha: float | None = None, theta: float = 10000.0,
              key: str = "xdrope_section") -> HunYuanVLTextConfig:
    rope: dict = {"rope_type": "xdrope" if alpha else "default", "rope_theta": theta, key: section}
    if alpha:
        rope.update(alpha=alpha, **HUNYUAN_KEYS)
    return HunYuanVLTextConfig(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim, num_hidden_layers=1,
                               intermediate_size=32, vocab_size=64, rope_parameters=rope)


def hf_rotation(config: HunYuanVLTextConfig, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
    rotary = hvl.HunYuanVLRotaryEmbedding(config)
    cos, sin = rotary(q, positions)  # (B, T, D), the doubled angles split over the axes
    return hvl.apply_rotary_pos_emb(q, k, cos, sin), rotary


CASES = [
    ([4, 4, 4, 4], None, 10000.0, "xdrope_section"),  # Hunyuan-VL's equal quarters, default frequencies
    ([4, 4, 4, 4], 1000.0, 10000.0, "xdrope_section"),  # with Hunyuan's NTK-alpha (its checkpoints' "xdrope" type)
    ([2, 6, 5, 3], 50.0, 5e5, "mrope_section"),  # unequal sections, the canonical key name
    ([8, 0, 0, 8], None, 100.0, "xdrope_section"),  # empty axes
]


@pytest.mark.parametrize("section,alpha,theta,key", CASES)
def test_matches_transformers_hunyuan_vl_rotation(section, alpha, theta, key) -> None:
    config = hf_config(section, alpha=alpha, theta=theta, key=key)
    scaling = {"rope_type": "ntk_alpha", "alpha": alpha} if alpha else None
    enc = posenc.build("xdrope", num_heads=2, head_dim=32, base=theta, xdrope_section=section, scaling=scaling)
    torch.manual_seed(0)
    b, t = 2, 11
    positions = torch.randint(0, 40, (4, b, t))  # every axis different: the general case
    q, k = torch.randn(2, b, 2, t, 32).unbind(0)
    (want_q, want_k), rotary = hf_rotation(config, q, k, positions)
    torch.testing.assert_close(enc.inv_freq, rotary.inv_freq.float(), rtol=1e-6, atol=0)
    got_q, got_k = enc.rotate(q, k, positions, positions)
    torch.testing.assert_close(got_q, want_q, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=1e-5)
    # float64 inputs: the same rotation, cast back once
    got64, _ = enc.rotate(q.double(), k.double(), positions, positions)
    assert got64.dtype == torch.float64
    torch.testing.assert_close(got64, want_q.double(), rtol=0, atol=1e-5)


def test_the_halves_of_a_pair_read_different_axes() -> None:
    """The assignment is per feature: with (16, 16, 16, 16) at D = 128 the first halves read axes
    0, 1 and the second halves 2, 3; a pair is not a rotation when its axes' ids differ."""
    enc = XDRoPE(1, 128, xdrope_section=[16, 16, 16, 16])
    axes = enc.axis_of_feature
    assert axes[:32].eq(0).all() and axes[32:64].eq(1).all() and axes[64:96].eq(2).all() and axes[96:].eq(3).all()
    x = torch.randn(1, 1, 1, 128, dtype=torch.float64)
    pos = torch.tensor([3, 50, 7, 1]).view(4, 1)
    y, _ = enc.rotate(x, x, pos, pos)
    assert abs(y.norm() - x.norm()) > 1e-3  # not norm-preserving: not a rotation
    same = torch.full((4, 1), 9)
    y, _ = enc.rotate(x, x, same, same)
    torch.testing.assert_close(y.norm(), x.norm())


def test_text_ids_are_rope() -> None:
    """Equal ids on every axis (text), or 1-D positions: exactly 1-D RoPE at that position."""
    enc = posenc.build("xdrope", num_heads=2, head_dim=16, scaling={"rope_type": "ntk_alpha", "alpha": 8.0})
    rope = posenc.build("rope", num_heads=2, head_dim=16, scaling={"rope_type": "ntk_alpha", "alpha": 8.0})
    q, k = torch.randn(2, 1, 2, 7, 16).unbind(0)
    pos = torch.tensor([0, 1, 4, 9, 10, 30, 31])
    want = rope.rotate(q, k, pos, pos)
    for given in (pos, pos.expand(4, 7), pos.expand(4, 1, 7)):
        got = enc.rotate(q, k, given, given)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-6)


def test_attend_with_four_axis_ids_equals_the_rotated_plain_attention_and_decodes() -> None:
    enc = posenc.build("xdrope", num_heads=2, head_dim=16)
    torch.manual_seed(1)
    ids = torch.randint(0, 20, (4, 2, 9))
    q, k, v = torch.randn(3, 2, 2, 9, 16, dtype=torch.float64).unbind(0)
    qr, kr = enc.rotate(q, k, ids, ids)
    want = torch.nn.functional.scaled_dot_product_attention(qr, kr, v, is_causal=True)
    got = posenc.attend(q, k, v, enc, positions=ids)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    # A posenc.Attention with a KV cache, fed the ids step by step, equals its full pass.
    attn = posenc.Attention(32, 2, enc).double()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    with torch.no_grad():
        full = attn(x, ids)
        cache = LayerCache()
        steps = [attn(x[:, :5], ids[..., :5], cache)]
        steps += [attn(x[:, t : t + 1], ids[..., t : t + 1], cache) for t in range(5, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
def test_every_backend_agrees_with_eager(causal: bool) -> None:
    check_backends(posenc.build("xdrope", num_heads=agreement.H, head_dim=agreement.D, causal=causal,
                                scaling={"rope_type": "ntk_alpha", "alpha": 4.0}), causal)


@pytest.mark.parametrize("options,message", [
    (dict(head_dim=15), "xdrope needs an even head_dim, got 15"),
    (dict(xdrope_section=[4, 4, 4]), "xdrope_section must be 4 non-negative integers ('position', 'width', 'height', 'image'), got [4, 4, 4]"),
    (dict(xdrope_section=[4, 4, 4, 5]), "xdrope_section must sum to head_dim/2 = 8, got [4, 4, 4, 5] (sum 17)"),
    (dict(xdrope_section=[2, 2, 2, 2.0]),
     "xdrope_section must be 4 non-negative integers ('position', 'width', 'height', 'image'), got [2, 2, 2, 2.0]"),
    (dict(base=1.0), "base must be a finite number in (1, 1e12], got 1.0"),
    (dict(scaling={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8}),
     "xdrope: scaling 'dynamic' is not supported (static frequency schedules over the whole head only: no dynamic, "
     "longrope or partial_rotary_factor)"),
    (dict(base=500.0, scaling={"rope_type": "ntk_alpha", "alpha": 2.0, "rope_theta": 100.0}),
     "base=500.0 disagrees with the scaling block's rope_theta=100.0; give one of them"),
])
def test_bad_options(options: dict, message: str) -> None:
    sizes = {"num_heads": 2, "head_dim": 16, **options}
    with pytest.raises(UsageError) as err:
        posenc.build("xdrope", **sizes)
    assert str(err.value) == message


def test_bad_positions() -> None:
    enc = posenc.build("xdrope", num_heads=2, head_dim=16)
    q = torch.randn(1, 2, 5, 16)
    with pytest.raises(UsageError, match=r"got 3 axes, xdrope has 4"):
        enc.rotate(q, q, torch.zeros(3, 5, dtype=torch.long), torch.zeros(3, 5, dtype=torch.long))
    with pytest.raises(UsageError, match=r"must be >= 0"):
        enc.rotate(q, q, torch.full((4, 5), -1), torch.zeros(4, 5, dtype=torch.long))


@pytest.mark.parametrize("form", ["object", "config.json"])
def test_xdrope_from_hf_reads_a_hunyuan_vl_config(form: str) -> None:
    """The published form (``rope_scaling`` with ``"type": "xdrope"``, ``xdrope_section`` and Hunyuan's
    alpha beside its unread keys), as a dict and through transformers' config class: the rotation of
    HunYuanVLRotaryEmbedding built from the same config."""
    raw = {"model_type": "hunyuan_vl_text", "hidden_size": 64, "num_attention_heads": 2, "head_dim": 32,
           "rope_scaling": {"type": "xdrope", "alpha": 100.0, "xdrope_section": [2, 6, 4, 4], "rope_theta": 5e5, **HUNYUAN_KEYS}}
    config = HunYuanVLTextConfig(num_hidden_layers=1, intermediate_size=32, vocab_size=64,
                                 **{k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items() if k != "model_type"})
    enc = xdrope_from_hf(config if form == "object" else {"text_config": raw})
    assert enc.xdrope_section == [2, 6, 4, 4] and enc.base == 5e5 and enc.scaling.rope_type == "ntk_alpha"
    torch.manual_seed(4)
    positions = torch.randint(0, 30, (4, 1, 8))
    q, k = torch.randn(2, 1, 2, 8, 32).unbind(0)
    (want_q, want_k), _ = hf_rotation(config, q, k, positions)
    got_q, got_k = enc.rotate(q, k, positions, positions)
    torch.testing.assert_close(got_q, want_q, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=1e-5)
    with pytest.raises(UsageError, match=r"^xdrope_from_hf: xdrope_section \[2, 6, 4, 4\] and mrope_section \[4, 4, 4, 4\] differ"):
        xdrope_from_hf({**raw, "rope_scaling": {**raw["rope_scaling"], "mrope_section": [4, 4, 4, 4]}})
    with pytest.raises(UsageError, match=r"^xdrope_from_hf: rope_type 'yarn' is not supported"):
        xdrope_from_hf({**raw, "rope_scaling": {"type": "yarn", "factor": 2.0}})
