"""KERPLE (Chi et al. 2022): the log and power biases against a float64 re-derivation of the paper's
equations, ALiBi as a special case, the clamp, learning, backends, cache and memory."""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from agreement import D, H, assert_decoding_equals_full, check_backends, check_flex_inference, largest_tensor
from posenc.backends import flex
from posenc.encodings import alibi_slopes
from posenc.errors import UsageError


def formula(variant: str, r1: list[float], r2: list[float], q_positions, k_positions, causal: bool) -> torch.Tensor:
    """b_h(i, j) = -r1_h log(1 + r2_h |i - j|)  or  -r1_h |i - j|^r2_h, written out in float64."""
    out = torch.zeros(len(r1), len(q_positions), len(k_positions), dtype=torch.float64)
    for h in range(len(r1)):
        for a, i in enumerate(q_positions):
            for b, j in enumerate(k_positions):
                d = abs(i - j)  # a decoder masks j > i; the formula itself is symmetric
                out[h, a, b] = -r1[h] * (math.log(1 + r2[h] * d) if variant == "log" else d ** r2[h])
    return out


@pytest.mark.parametrize("variant", ["log", "power"])
@pytest.mark.parametrize("causal", [True, False])
def test_bias_is_the_papers_formula(variant, causal):
    enc = posenc.build("kerple", num_heads=H, head_dim=D, causal=causal, variant=variant).double()
    r1, r2 = [0.3, 0.05, 1.7, 0.8], [0.4, 1.5, 0.02, 1.0]
    with torch.no_grad():
        enc.r1.copy_(torch.tensor(r1, dtype=torch.float64))
        enc.r2.copy_(torch.tensor(r2, dtype=torch.float64))
    qp, kp = [7, 8, 9, 30], [0, 3, 7, 8, 9, 29, 30, 31]  # gaps and a key after every query
    want = formula(variant, r1, r2, qp, kp, causal)
    got = enc.bias(torch.tensor(qp), torch.tensor(kp))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # score (fused kernels) and relative_bias (r = j - i) are the same function
    heads = torch.arange(H)[:, None, None]
    torch.testing.assert_close(enc.score(heads, torch.tensor(qp)[None, :, None], torch.tensor(kp)[None, None, :]), want)
    r = torch.tensor(kp) - 9
    torch.testing.assert_close(enc.relative_bias(r), want[:, 2, :])


@pytest.mark.parametrize("causal", [True, False])
def test_power_with_exponent_one_and_alibi_slopes_is_alibi(causal):
    kerple = posenc.build("kerple", num_heads=8, head_dim=D, causal=causal, variant="power")
    alibi = posenc.build("alibi", num_heads=8, head_dim=D, causal=causal)
    slopes = alibi_slopes(8)  # 1/2 .. 1/256
    with torch.no_grad():
        kerple.r1.copy_(slopes)
        kerple.r2.fill_(1.0)
    pos = torch.arange(40)
    # Wherever a query may see the key (a decoder's ALiBi extends -m (i - j) into the masked
    # future, KERPLE -m |i - j|), exactly: both compute slope x distance in float32.
    seen = torch.ones(40, 40, dtype=torch.bool) if not causal else torch.ones(40, 40, dtype=torch.bool).tril()
    got, want = kerple.bias(pos, pos)[:, seen], alibi.bias(pos, pos)[:, seen]
    kept = slopes >= 1e-2  # the clamp at 1e-2 (the authors' code) holds the two gentlest heads at 1e-2
    assert kept.tolist() == [True] * 6 + [False] * 2
    torch.testing.assert_close(got[kept], want[kept], rtol=0, atol=0)
    torch.testing.assert_close(got[~kept], want[~kept] / slopes[~kept, None] * 1e-2, rtol=1e-6, atol=0)


def test_values_are_clamped_and_the_gradient_passes_the_clamp():
    enc = posenc.build("kerple", num_heads=2, head_dim=D, variant="power")
    with torch.no_grad():
        enc.r1.copy_(torch.tensor([-0.5, 0.3]))
        enc.r2.copy_(torch.tensor([2.5, 0.001]))
    r1, r2 = enc.values()
    assert r1.tolist() == pytest.approx([1e-2, 0.3]) and r2.tolist() == pytest.approx([2.0, 1e-2])
    bias = enc.bias(torch.tensor([5]), torch.arange(5))
    torch.testing.assert_close(bias[0, 0], -1e-2 * torch.arange(5, 0, -1).float() ** 2)
    bias.sum().backward()
    # as in the authors' code (the parameter's data is clamped, the parameter differentiated): a
    # value held at its bound still gets a gradient, so it can come back
    assert (enc.r1.grad != 0).all() and (enc.r2.grad != 0).all()


def test_parameters_learn():
    """An early port stored r1, r2 as constants (the bias was always 0). Here a KERPLE fits the
    attention pattern of another one: its loss falls and its parameters move to the target's."""
    torch.manual_seed(0)
    target = posenc.build("kerple", num_heads=2, head_dim=D)
    with torch.no_grad():
        target.r1.copy_(torch.tensor([1.5, 0.4]))
        target.r2.copy_(torch.tensor([0.8, 0.1]))
    student = posenc.build("kerple", num_heads=2, head_dim=D)
    with torch.no_grad():
        student.r1.fill_(0.5)
        student.r2.fill_(0.5)
    pos = torch.arange(48)
    mask = torch.ones(48, 48, dtype=torch.bool).tril()
    want = torch.softmax(target.bias(pos, pos).masked_fill(~mask, float("-inf")), -1).detach()
    opt = torch.optim.Adam(student.parameters(), lr=0.05)
    losses = []
    for _ in range(300):
        logp = torch.log_softmax(student.bias(pos, pos).masked_fill(~mask, float("-inf")), -1)
        loss = -(want * logp.masked_fill(~mask, 0)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0
    torch.testing.assert_close(student.bias(pos, pos)[:, mask], target.bias(pos, pos)[:, mask], rtol=0, atol=0.05)


def test_shared_by_every_layer_and_learned_in_the_model():
    model = posenc.LM(posenc.LMConfig(encoding="kerple", dim=32, depth=3, num_heads=4))
    assert all(block.attn.encoding is model.encoding for block in model.blocks)
    assert [n for n, _ in model.named_parameters() if "r1" in n or "r2" in n] == ["encoding.r1", "encoding.r2"]
    before = model.encoding.bias(torch.arange(5), torch.arange(5)).detach()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    tokens = torch.randint(0, 256, (2, 24))
    torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten()).backward()
    assert model.encoding.r1.grad.abs().min() > 0 and model.encoding.r2.grad.abs().min() > 0
    opt.step()
    assert not torch.allclose(model.encoding.bias(torch.arange(5), torch.arange(5)), before)


@pytest.mark.parametrize("variant", ["log", "power"])
@pytest.mark.parametrize("causal", [True, False])
def test_every_backend_agrees_with_eager(variant, causal):
    torch.manual_seed(1)
    enc = posenc.build("kerple", num_heads=H, head_dim=D, causal=causal, variant=variant)
    seen = check_backends(enc, causal, expect=("blocked", "sdpa", "eager"))
    assert "flex" not in seen  # no CPU backward


def test_auto_runs_blocked_without_a_quadratic_tensor():
    largest, backend = largest_tensor("kerple")
    assert backend == "blocked"
    assert largest < 1024 * 1024, largest  # below one (N, N) square at N=1024


@pytest.mark.parametrize("variant", ["log", "power"])
def test_cached_decoding_equals_full_pass(variant):
    model = posenc.LM(posenc.LMConfig(encoding="kerple", dim=32, depth=2, num_heads=4, encoding_options={"variant": variant})).eval()
    assert_decoding_equals_full(model)


def test_bad_variant_is_a_usage_error():
    with pytest.raises(UsageError, match=r"variant must be one of \('log', 'power'\), got 'linear'"):
        posenc.build("kerple", num_heads=2, head_dim=4, variant="linear")


@pytest.mark.skipif(not flex.compile_available("cpu"), reason="torch.compile cannot build CPU kernels here")
def test_flex_agrees_with_eager_for_cpu_inference():
    check_flex_inference(posenc.build("kerple", num_heads=H, head_dim=D))
