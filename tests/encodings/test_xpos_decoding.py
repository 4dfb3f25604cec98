"""Centred xPos decoding in a KV cache frame (``XPos.rotate_in_frame``): each step rotates only the
new tokens, the cache is re-centred only when the length doubles (or near the dtype's range), and
the logits equal the full pass to float32 rounding at long caches, re-centres included."""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc.encodings import xpos as xpos_module

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def model(scale_base: float, depth: int = 1, **options) -> posenc.LM:
    torch.manual_seed(0)
    config = posenc.LMConfig(encoding="xpos", dim=16, depth=depth, num_heads=2, vocab_size=32,
                             encoding_options={"scale_base": scale_base, **options})
    return posenc.LM(config).eval()


def decoded(m: posenc.LM, tokens: torch.Tensor, prefill: int) -> torch.Tensor:
    cache = m.new_cache(tokens.shape[0])
    with torch.inference_mode():
        parts = [m(tokens[:, :prefill], cache=cache)]
        parts += [m(tokens[:, i : i + 1], cache=cache) for i in range(prefill, tokens.shape[1])]
    return torch.cat(parts, 1)


class Count:
    """Rows the xPos module rotates (new keys and queries) and re-centres, per call."""

    def __init__(self, monkeypatch) -> None:
        self.rotated, self.recentred = [], 0
        real_rotation, real_scale = xpos_module.apply_rotation, xpos_module.XPos._pair_scale

        def rotation(x, *args, **kwargs):
            self.rotated.append(x.shape[-2])
            return real_rotation(x, *args, **kwargs)

        def scale(enc, *args, **kwargs):
            self.recentred += 1
            return real_scale(enc, *args, **kwargs)

        monkeypatch.setattr(xpos_module, "apply_rotation", rotation)
        monkeypatch.setattr(xpos_module.XPos, "_pair_scale", scale)


@pytest.mark.parametrize("scale_base,length", [(512.0, 2048), (16.0, 1100), (8.0, 560)])
def test_decoding_equals_the_full_pass_at_long_caches(scale_base, length) -> None:
    # 512: the paper's scale, one re-centre per doubling; 16: factors up to e^43 in the full pass;
    # 8: past the doubling rule, the farthest centre position 0 allows (near float32's range).
    m = model(scale_base)
    tokens = torch.randint(0, 32, (2, length))
    with torch.inference_mode():
        full = m(tokens)
    torch.testing.assert_close(decoded(m, tokens, 5), full, rtol=0, atol=2e-5)


def test_two_layers_equal_the_full_pass() -> None:
    m = model(64.0, depth=2)
    tokens = torch.randint(0, 32, (1, 700))
    with torch.inference_mode():
        full = m(tokens)
    torch.testing.assert_close(decoded(m, tokens, 3), full, rtol=0, atol=2e-5)


def test_a_step_rotates_only_the_new_token_and_recentres_when_the_length_doubles(monkeypatch) -> None:
    m = model(512.0)
    tokens = torch.randint(0, 32, (1, 1030))
    count = Count(monkeypatch)
    decoded(m, tokens, 6)
    # prefill: q and k of 6 rows; then every step q and k of one row (before: every cached key per step)
    assert count.rotated[:2] == [6, 6] and set(count.rotated[2:]) == {1}
    # centre 3 after the prefill, then 7, 15, ..., 1023 once the newest key passes twice the centre
    assert count.recentred == 8  # 7, 15, 31, 63, 127, 255, 511, 1023: log2 of the length


def test_crop_reset_and_autograd_keep_the_frame_consistent() -> None:
    m = model(32.0)
    tokens = torch.randint(0, 32, (1, 300))
    with torch.inference_mode():
        full = m(tokens)
    cache = m.new_cache(1)
    with torch.inference_mode():
        m(tokens[:, :200], cache=cache)
        for i in range(200, 260):
            m(tokens[:, i : i + 1], cache=cache)
        cache.crop(150)  # forget 110 tokens (past two re-centres), continue from 150
        steps = [m(tokens[:, i : i + 1], cache=cache) for i in range(150, 300)]
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 150:], rtol=0, atol=2e-5)
    cache.reset()
    with torch.inference_mode():
        again = [m(tokens[:, :10], cache=cache)] + [m(tokens[:, i : i + 1], cache=cache) for i in range(10, 40)]
    torch.testing.assert_close(torch.cat(again, 1), full[:, :40], rtol=0, atol=2e-5)
    # under autograd nothing is written in place; the logits are the same
    m.train(False)
    cache = m.new_cache(1)
    parts = [m(tokens[:, :20], cache=cache)] + [m(tokens[:, i : i + 1], cache=cache) for i in range(20, 80)]
    assert parts[-1].requires_grad
    torch.testing.assert_close(torch.cat(parts, 1).detach(), full[:, :80], rtol=0, atol=2e-5)
    torch.cat(parts, 1).sum().backward()  # a graph through every step


def test_generation_of_centred_xpos_is_unchanged() -> None:
    m = model(16.0, depth=2)
    prompts = [torch.randint(0, 32, (n,)) for n in (5, 9)]
    out = m.generate(prompts, 40)
    for b, p in enumerate(prompts):
        alone = m.generate(p[None], 40)
        assert torch.equal(out[b, 9 - p.numel():], alone[0])
    with torch.inference_mode():  # greedy: the argmax of the full forward
        logits = m(alone)
    assert torch.equal(alone[0, 9:], logits[0, 8:-1].argmax(-1))
