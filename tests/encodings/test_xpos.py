"""xPos (Sun et al. 2022) against the authors' torchscale ``XPOS`` and x-transformers'
``RotaryEmbedding(use_xpos=True)``; the decay; cached keys; blockwise causal attention.

Conventions: xPos is interleaved (pairs 2k, 2k+1). torchscale centres the decay exponents on
``ceil(l/2)`` (l = current length), x-transformers on ``floor(l/2)``: the centre cancels in every
score, so both give the same scores, and the same vectors when l is even. Their angles are float32
products, so the tolerance grows with the position as in tests/encodings/test_rope.py.
"""

from __future__ import annotations

import math

import pytest
import torch

import posenc
import posenc.hf
from posenc.encodings import has_hook
from posenc.errors import UsageError

xpos_relative_position = pytest.importorskip("torchscale.component.xpos_relative_position")
x_transformers = pytest.importorskip("x_transformers.x_transformers")
rotary_embedding_torch = pytest.importorskip("rotary_embedding_torch")


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny tensors run on one thread


H = 2


def qk(t: int, d: int, b: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = torch.randn(2, b, H, t, d).unbind(0)  # (B, H, T, D)
    return q, k


def atol_for(t: int, x: torch.Tensor, largest_factor: float) -> float:
    return max(1e-5, t * 2.0**-22 * float(x.abs().max()) * largest_factor)


def torchscale(x: torch.Tensor, offset: int = 0, downscale: bool = False) -> torch.Tensor:
    """torchscale works on (B*H, T, D)."""
    b, h, t, d = x.shape
    out = xpos_relative_position.XPOS(d)(x.reshape(b * h, t, d), offset=offset, downscale=downscale)
    return out.reshape(b, h, t, d)


@pytest.mark.parametrize("t", [1, 7, 64, 301])
@pytest.mark.parametrize("d", [16, 48])
def test_full_pass_equals_torchscale(t: int, d: int) -> None:
    enc = posenc.build("xpos", num_heads=H, head_dim=d)
    q, k = qk(t, d)
    pos = torch.arange(t)
    q_got, k_got = enc.rotate(q, k, pos, pos)
    q_ref, k_ref = torchscale(q), torchscale(k, downscale=True)
    factor = math.exp(t / 2 / 512 * -math.log(0.4 / 1.4))
    torch.testing.assert_close(q_got, q_ref, rtol=0, atol=atol_for(t, q, factor))
    torch.testing.assert_close(k_got, k_ref, rtol=0, atol=atol_for(t, k, factor))


@pytest.mark.parametrize("n", [9, 40])
def test_decoding_step_equals_torchscale_incremental_path(n: int) -> None:
    """torchscale's decoder keeps keys un-rotated and re-applies xPos to all of them at each step,
    the query with offset n - 1: one centre, ceil(n/2), for both. So does posenc."""
    d = 16
    enc = posenc.build("xpos", num_heads=H, head_dim=d)
    q, _ = qk(1, d)
    _, k = qk(n, d)
    q_got, k_got = enc.rotate(q, k, torch.tensor([n - 1]), torch.arange(n))
    torch.testing.assert_close(q_got, torchscale(q, offset=n - 1), rtol=0, atol=1e-5)
    torch.testing.assert_close(k_got, torchscale(k, downscale=True), rtol=0, atol=1e-5)


@pytest.mark.parametrize("t", [16, 17, 200])
def test_equals_x_transformers(t: int) -> None:
    d = 32
    enc = posenc.build("xpos", num_heads=H, head_dim=d)
    q, k = qk(t, d)
    pos = torch.arange(t)
    q_got, k_got = enc.rotate(q, k, pos, pos)
    freqs, scale = x_transformers.RotaryEmbedding(d, use_xpos=True, scale_base=512)(pos)
    q_ref = x_transformers.apply_rotary_pos_emb(q, freqs, scale)
    k_ref = x_transformers.apply_rotary_pos_emb(k, freqs, scale**-1.0)
    atol = atol_for(t, torch.cat((q, k)), 1.01)
    torch.testing.assert_close(q_got @ k_got.transpose(-1, -2), q_ref @ k_ref.transpose(-1, -2), rtol=0, atol=10 * atol)
    if t % 2 == 0:  # same centre: the same vectors
        torch.testing.assert_close(q_got, q_ref, rtol=0, atol=atol)
        torch.testing.assert_close(k_got, k_ref, rtol=0, atol=atol)
    else:  # centres one position apart: different vectors, same scores (checked above)
        assert not torch.allclose(q_got, q_ref, atol=1e-4)


def test_decay_per_pair() -> None:
    """The norm of pair k of a rotated query at n is |q_k| zeta_k^((n - c)/scale_base), of a key
    |k_k| zeta_k^(-(n - c)/scale_base): score terms of pair k carry zeta_k^((i - j)/scale_base)."""
    d, t, scale_base = 16, 50, 64.0
    enc = posenc.build("xpos", num_heads=1, head_dim=d, scale_base=scale_base)
    x = torch.randn(1, 1, 1, d).expand(1, 1, t, d)
    pos = torch.arange(t)
    q_rot, k_rot = enc.rotate(x, x, pos, pos)

    def pair_norms(v: torch.Tensor) -> torch.Tensor:
        return v[0, 0].view(t, d // 2, 2).norm(dim=-1)  # (T, d/2), interleaved pairs

    zeta = (torch.arange(0, d, 2, dtype=torch.float64) / d + 0.4) / 1.4
    exponent = (pos.double() - math.ceil(t / 2))[:, None] / scale_base
    torch.testing.assert_close(pair_norms(q_rot).double(), pair_norms(x).double() * zeta**exponent, rtol=1e-5, atol=0)
    torch.testing.assert_close(pair_norms(k_rot).double(), pair_norms(x).double() * zeta**-exponent, rtol=1e-5, atol=0)
    scores = q_rot[0, 0] @ k_rot[0, 0].T  # (T, T): decays with i - j for i > j
    assert scores.diagonal(-40).abs().mean() < scores.diagonal(-1).abs().mean()


def test_cached_keys_right_where_rotary_embedding_torch_is_wrong() -> None:
    """rotary-embedding-torch 0.9.1 centres the query and the cached keys at different offsets:
    its cached scores differ from its own full pass. posenc's decoding step equals the full pass."""
    d, n = 32, 256
    q, k = qk(n, d)
    pos = torch.arange(n)
    peer = rotary_embedding_torch.RotaryEmbedding(dim=d, use_xpos=True, cache_if_possible=False)
    q_full, k_full = peer.rotate_queries_and_keys(q, k)
    q_step, k_step = peer.rotate_queries_with_cached_keys(q[:, :, -1:], k)
    full_last = (q_full[:, :, -1:] @ k_full.transpose(-1, -2))
    peer_gap = (q_step @ k_step.transpose(-1, -2) - full_last).abs().max().item()
    assert peer_gap > 1e-2  # the peer's bug, so this test can see one

    enc = posenc.build("xpos", num_heads=H, head_dim=d)
    qf, kf = enc.rotate(q, k, pos, pos)
    qs, ks = enc.rotate(q[:, :, -1:], k, pos[-1:], pos)
    ours_gap = (qs @ ks.transpose(-1, -2) - qf[:, :, -1:] @ kf.transpose(-1, -2)).abs().max().item()
    assert ours_gap < 1e-5
    # ... and our full pass gives the peer's full-pass scores (the peer is right without a cache).
    torch.testing.assert_close(qf @ kf.transpose(-1, -2), q_full @ k_full.transpose(-1, -2), rtol=0, atol=1e-3)


def test_centring_is_a_per_length_choice_only() -> None:
    """Centred and uncentred xPos give the same scores; only the centred one depends on the length
    (so the attention re-rotates its cached keys for it)."""
    d, t = 16, 30
    centred = posenc.build("xpos", num_heads=H, head_dim=d)
    plain = posenc.build("xpos", num_heads=H, head_dim=d, centre=False)
    assert centred.rotation_depends_on_length and not plain.rotation_depends_on_length
    q, k = qk(t, d)
    pos = torch.arange(100, 100 + t)
    a = centred.rotate(q, k, pos, pos)
    b = plain.rotate(q, k, pos, pos)
    torch.testing.assert_close(a[0] @ a[1].transpose(-1, -2), b[0] @ b[1].transpose(-1, -2), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a[0], b[0], atol=1e-3)


def test_decay_factors_that_overflow_are_usage_errors() -> None:
    d = 16
    q, k = qk(3, d)
    plain = posenc.build("xpos", num_heads=H, head_dim=d, centre=False)
    centred = posenc.build("xpos", num_heads=H, head_dim=d)
    far = torch.arange(20000, 20003)
    with pytest.raises(posenc.UsageError, match="scale_base"):
        plain.rotate(q, k, far, far)  # zeta_0^(-20000/512) ~ 1e21 > sqrt(float32 max)
    with pytest.raises(posenc.UsageError, match="float16"):
        centred.rotate(q.half(), k.half(), torch.arange(5000, 5003), torch.arange(5000, 5003))  # |n - c| ~ 2500
    q_far, _ = centred.rotate(q, k, far, far)  # centred: |n - c| <= 10002
    assert torch.isfinite(q_far).all()
    wide = posenc.build("xpos", num_heads=H, head_dim=d, centre=False, scale_base=4096)
    assert torch.isfinite(wide.rotate(q, k, far, far)[1]).all()


def test_bad_uses_are_usage_errors() -> None:
    with pytest.raises(ValueError, match="causal"):
        posenc.build("xpos", num_heads=H, head_dim=16, causal=False)
    enc = posenc.build("xpos", num_heads=H, head_dim=16)
    q, k = qk(4, 16)
    with pytest.raises(posenc.UsageError, match="positions"):
        enc.rotate(q, k, torch.arange(-1, 3), torch.arange(-1, 3))
    with pytest.raises(posenc.UsageError, match="head_dim"):
        enc.rotate(*qk(4, 32), torch.arange(4), torch.arange(4))
    for option, value in (("scale_base", 0), ("layout", "spiral"), ("centre", 1), ("block_size", 0)):
        with pytest.raises(ValueError, match=option):  # UsageError is a ValueError
            posenc.build("xpos", num_heads=H, head_dim=16, **{option: value})


# ---- blockwise causal attention ------------------------------------------------------------------


def test_block_hooks_exist_only_with_a_block_size() -> None:
    assert not has_hook(posenc.build("xpos", num_heads=H, head_dim=16), "bias")
    assert not has_hook(posenc.build("xpos", num_heads=H, head_dim=16), "score")
    enc = posenc.build("xpos", num_heads=H, head_dim=16, block_size=4)
    assert has_hook(enc, "bias") and has_hook(enc, "score")
    bias = enc.bias(torch.arange(12), torch.arange(12))  # (H, 12, 12)
    allowed = bias[0] == 0
    # Query 9 (block 2) sees keys 4..11 (blocks 1 and 2); the causal mask then cuts 10, 11.
    assert allowed[9].nonzero().flatten().tolist() == list(range(4, 12))
    assert allowed[3].all() and torch.isinf(bias).any() and torch.equal(bias[0], bias[1])


@pytest.mark.parametrize("backend", ["eager", "sdpa", "blocked"])
@pytest.mark.parametrize("centre", [True, False])
def test_blockwise_attention_is_each_block_with_its_predecessor(backend: str, centre: bool) -> None:
    """Every block of queries gets exactly what plain xPos attention over (previous block + its
    own block) gives: the definition of blockwise causal attention, computed without the mask."""
    torch.manual_seed(0)
    w, n, dim = 5, 23, 32
    blockwise = posenc.build("xpos", num_heads=H, head_dim=dim // H, centre=centre, block_size=w)
    plain = posenc.build("xpos", num_heads=H, head_dim=dim // H, centre=centre)
    attn = posenc.Attention(dim, H, blockwise, backend=backend)
    reference = posenc.Attention(dim, H, plain, backend="eager")
    reference.load_state_dict(attn.state_dict())
    x = torch.randn(2, n, dim)
    with torch.no_grad():
        got = attn(x)
        for start in range(0, n, w):
            lo = max(0, start - w)
            window = reference(x[:, lo : start + w], positions=torch.arange(lo, min(start + w, n)))
            torch.testing.assert_close(got[:, start : start + w], window[:, start - lo :], rtol=0, atol=2e-5)
        unblocked = posenc.Attention(dim, H, plain, backend="eager")
        unblocked.load_state_dict(attn.state_dict())
        assert not torch.allclose(got, unblocked(x), atol=1e-3)  # the mask does act


def test_the_xpos_refusal_advises_what_is_not_in_effect() -> None:
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
