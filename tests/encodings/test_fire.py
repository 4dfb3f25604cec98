"""FIRE (Li et al. 2023): the bias against a float64 re-derivation of the paper's equation, its two
regimes (below the threshold L a function of i - j, beyond it the normalised form), backends, cache,
memory and options."""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from agreement import D, H, assert_decoding_equals_full, check_backends, check_flex_inference, largest_tensor
from posenc.backends import flex
from posenc.errors import UsageError


def formula(enc, q_positions, k_positions) -> torch.Tensor:
    """b_h(i, j) = f_h(psi(i - j) / (psi(max(L, i)) + 1e-6)), psi(x) = log(|c x| + 1),
    L = |L_mult * threshold|, f: 1 -> W -> H with a ReLU; written out in float64 from the weights."""
    w1, b1, w2, b2 = (p.detach().double().tolist() for p in (enc.w1, enc.b1, enc.w2, enc.b2))
    c, big_l = float(enc.c), abs(float(enc.threshold_scale) * enc.threshold)
    psi = lambda x: math.log(abs(c * x) + 1)  # noqa: E731
    out = torch.zeros(len(b2), len(q_positions), len(k_positions), dtype=torch.float64)
    for a, i in enumerate(q_positions):
        for b, j in enumerate(k_positions):
            x = psi(i - j) / (psi(max(big_l, i)) + 1e-6)
            hidden = [max(0.0, w * x + bb) for w, bb in zip(w1, b1)]
            for h in range(len(b2)):
                out[h, a, b] = sum(w * z for w, z in zip(w2[h], hidden)) + b2[h]
    return out


def test_initial_values_are_the_papers():
    enc = posenc.build("fire", num_heads=H, head_dim=D)
    assert float(enc.c) == pytest.approx(0.1) and float(enc.threshold_scale) == 1.0 and enc.threshold == 512.0
    assert enc.w1.shape == (32,) and enc.w2.shape == (H, 32)
    assert enc.causal_only and not enc.shares_across_layers


@pytest.mark.parametrize("threshold", [512.0, 20.0])
def test_bias_is_the_papers_formula(threshold):
    torch.manual_seed(0)
    enc = posenc.build("fire", num_heads=H, head_dim=D, threshold=threshold).double()
    with torch.no_grad():
        enc.c.fill_(0.37)
        enc.threshold_scale.fill_(-0.8)  # |L_mult * threshold|: the sign does not matter
    qp, kp = [0, 3, 15, 16, 40, 700], [0, 1, 3, 9, 15, 16, 39, 40, 699, 700]
    want = formula(enc, qp, kp)
    torch.testing.assert_close(enc.bias(torch.tensor(qp), torch.tensor(kp)), want, rtol=0, atol=1e-12)
    heads = torch.arange(H)[:, None, None]
    torch.testing.assert_close(enc.score(heads, torch.tensor(qp)[None, :, None], torch.tensor(kp)[None, None, :]), want, rtol=0, atol=1e-12)
    f32 = posenc.build("fire", num_heads=H, head_dim=D, threshold=threshold)
    f32.load_state_dict(enc.state_dict())
    torch.testing.assert_close(f32.bias(torch.tensor(qp), torch.tensor(kp)).double(), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", ["all switch", "none switch", "mixed", "zero weights"])
def test_folded_units_are_the_mlp(case):
    """bias() keeps explicit only the units that switch within the call's range of x: the same
    values and gradients as the plain layer, whichever units those are."""
    torch.manual_seed(1)
    enc = posenc.build("fire", num_heads=3, head_dim=D, mlp_width=8).double()
    with torch.no_grad():
        if case == "all switch":  # switch points -b1/w1 spread inside (0, 1)
            enc.w1.copy_(torch.tensor([1.0, -1, 2, -2, 1, -1, 3, -3]))
            enc.b1.copy_(-enc.w1 * torch.linspace(0.1, 0.9, 8, dtype=torch.float64))
        elif case == "none switch":  # all outside [0, 1]: on or off for every pair
            enc.b1.copy_(torch.tensor([2.0, -2, 5, -5, 1.5, -1.5, 3, -3]))
            enc.w1.copy_(torch.tensor([0.5, 0.5, -1, 1, -0.2, 0.2, 1, -1]))
        elif case == "zero weights":
            enc.w1[::2] = 0.0
    qp, kp = torch.arange(30, 60), torch.arange(60)
    x = enc.normalized_distance(qp[:, None], kp[None, :])
    for p in enc.parameters():
        p.grad = None
    got = enc.bias(qp, kp)
    grads = torch.autograd.grad(got.sin().sum(), list(enc.parameters()))
    want = enc.mlp(x).permute(2, 0, 1)
    want_grads = torch.autograd.grad(want.sin().sum(), list(enc.parameters()))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)


def test_below_the_threshold_a_function_of_distance_beyond_it_normalised():
    enc = posenc.build("fire", num_heads=H, head_dim=D, threshold=100.0).double()
    keys = torch.arange(0, 400)
    bias = enc.bias(torch.arange(0, 400), keys)  # (H, 400, 400)
    # queries below L = 100: b(i, j) depends on i - j only (the normaliser is psi(L) for all)
    for i in (10, 37, 99):
        torch.testing.assert_close(bias[:, i, : i + 1].flip(-1), bias[:, 99, 99 - i : 100].flip(-1))
    # beyond L, the normalised form f(psi(i - j) / psi(i)): not the same function of i - j
    c = float(enc.c)  # 0.1 in float32
    psi = lambda x: torch.log1p(c * torch.as_tensor(x, dtype=torch.float64))  # noqa: E731
    x = psi(torch.arange(301)) / (psi(300) + 1e-6)  # query 300, distances 0..300
    torch.testing.assert_close(bias[:, 300, :301].flip(-1), enc.mlp(x).t(), rtol=0, atol=1e-12)
    assert (bias[:, 300, 300 - 50] - bias[:, 150, 100]).abs().max() > 1e-3  # same distance 50, other bias
    # key 0 seen from any query beyond L is at x = psi(i) / (psi(i) + eps), about 1: about one bias
    far = torch.arange(150, 400)
    torch.testing.assert_close(bias[:, 150:, 0], enc.mlp(psi(far) / (psi(far) + 1e-6)).t(), rtol=0, atol=1e-12)


def test_every_backend_agrees_with_eager():
    torch.manual_seed(2)
    enc = posenc.build("fire", num_heads=H, head_dim=D, threshold=40.0)  # queries on both sides of L
    check_backends(enc, True, expect=("blocked", "sdpa", "eager"))


def test_auto_runs_blocked_without_a_quadratic_tensor():
    largest, backend = largest_tensor("fire")
    assert backend == "blocked"
    assert largest < 1024 * 1024, largest


def test_cached_decoding_equals_full_pass_across_the_threshold():
    model = posenc.LM(posenc.LMConfig(encoding="fire", dim=32, depth=2, num_heads=4, encoding_options={"threshold": 8.0})).eval()
    assert model.blocks[0].attn.encoding is not model.blocks[1].attn.encoding  # one FIRE per layer
    assert_decoding_equals_full(model)


def test_threshold_and_scale_learn():
    model = posenc.LM(posenc.LMConfig(encoding="fire", dim=32, depth=1, num_heads=4, encoding_options={"threshold": 8.0}))
    tokens = torch.randint(0, 256, (2, 20))
    torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten()).backward()
    enc = model.encoding
    for name in ("w1", "b1", "w2", "c", "threshold_scale"):
        assert getattr(enc, name).grad.abs().sum() > 0, name


@pytest.mark.parametrize(
    "options, message",
    [
        ({"mlp_width": 0}, "mlp_width must be a positive integer"),
        ({"init_c": 0.0}, "init_c must be a positive number, got 0.0"),
        ({"init_c": float("nan")}, "init_c must be a positive number"),
        ({"threshold": -512.0}, "threshold must be a positive number, got -512.0"),
        ({"threshold": "512"}, "threshold must be a positive number"),
        ({"causal": False}, "no bidirectional form; use causal=True"),
    ],
)
def test_bad_options_are_usage_errors(options, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        posenc.build("fire", num_heads=2, head_dim=4, **options)


@pytest.mark.skipif(not flex.compile_available("cpu"), reason="torch.compile cannot build CPU kernels here")
def test_flex_agrees_with_eager_for_cpu_inference():
    check_flex_inference(posenc.build("fire", num_heads=H, head_dim=D, threshold=20.0, mlp_width=4))  # a short unrolled loop to compile
