"""The dynamic position bias (Wang et al. 2022; Swin V2's log-spaced input): against x-transformers'
``DynamicPositionBias`` with the same weights copied in (every depth, with and without the log input
and the LayerNorms; a whole attention layer), relative positions, every backend against eager,
cached decoding, packed rows, gradients, memory and errors."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import posenc
from agreement import H, assert_decoding_equals_full, check_backends, largest_tensor
from posenc.encodings.protocol import DistanceBias, offers
from posenc.errors import UsageError

W = 8  # the MLP's width in these tests


def dpb(causal: bool = True, seed: int = 0, **options) -> nn.Module:
    torch.manual_seed(seed)
    return posenc.build("dpb", num_heads=H, head_dim=16, causal=causal, width=W, **options)


@pytest.fixture
def x_transformers():
    return pytest.importorskip("x_transformers.x_transformers")


def copy_reference(enc: nn.Module, ref: nn.Module) -> None:
    """The reference's weights into posenc's encoding: its Linear layers in order, and its norms (the
    first, x-transformers' own LayerNorm, has a gain ``gamma`` only; the later ones are nn.LayerNorm)."""
    linears = [m for m in ref.mlp.modules() if isinstance(m, nn.Linear)]
    norms = [m for m in ref.mlp.modules() if hasattr(m, "gamma") or (isinstance(m, nn.LayerNorm) and m.elementwise_affine)]
    assert len(linears) == len(enc.weights) and len(norms) == len(enc.norm_gains)
    with torch.no_grad():
        for weight, bias, linear in zip(enc.weights, enc.biases, linears):
            weight.copy_(linear.weight)
            bias.copy_(linear.bias)
        for n, norm in enumerate(norms):
            if hasattr(norm, "gamma"):
                enc.norm_gains[n].copy_(norm.gamma)
            else:
                enc.norm_gains[n].copy_(norm.weight)
                enc.norm_biases[n - 1].copy_(norm.bias)
    assert sum(p.numel() for p in ref.parameters()) == sum(p.numel() for p in enc.parameters())


@pytest.mark.parametrize("depth, log_distance, norm", list(itertools.product([1, 2, 3], [False, True], [False, True])))
def test_bias_equals_x_transformers_dynamic_position_bias(x_transformers, depth, log_distance, norm):
    ref = x_transformers.DynamicPositionBias(W, heads=H, depth=depth, log_distance=log_distance, norm=norm)
    with torch.no_grad():
        for p in ref.parameters():  # away from the initial gains of 1 and biases of 0: every parameter matters
            p.normal_()
    for causal in (True, False):
        enc = dpb(causal, depth=depth, log_distance=log_distance, norm=norm)
        copy_reference(enc, ref)
        for tq, tk in ((13, 13), (4, 13), (1, 13)):  # a full pass, a cached chunk, one decoded query
            want = ref(tq, tk)  # (H, Tq, Tk): the queries are the last tq of the tk keys
            got = enc.bias(torch.arange(tk - tq, tk), torch.arange(tk))
            diff = (got - want).abs().max().item()
            assert diff < 1e-5 * max(1.0, want.abs().max().item()), diff  # seen: at most 3.8e-6 on biases of ~10
            torch.testing.assert_close(enc.relative_bias(torch.arange(tk) - (tk - 1)), want[:, -1], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_a_layer_equals_x_transformers_attention_with_the_bias(x_transformers, causal):
    """The whole layer (projections, 1/sqrt(D) scale, the bias in logit units, the mask) with the same
    weights, and the MLP's gradients."""
    d = 16
    ref = x_transformers.Attention(H * d, heads=H, dim_head=d, causal=causal)
    bias = x_transformers.DynamicPositionBias(W, heads=H, depth=2, log_distance=True)
    enc = dpb(causal, log_distance=True)
    copy_reference(enc, bias)
    layer = posenc.Attention(H * d, H, enc, causal=causal)
    with torch.no_grad():
        layer.qkv.weight.copy_(torch.cat((ref.to_q.weight, ref.to_k.weight, ref.to_v.weight)))
        layer.proj.weight.copy_(ref.to_out.weight)
    x = torch.randn(2, 70, H * d)
    got, want = layer(x), ref(x, rel_pos=bias)
    assert layer.last_backend == "blocked"
    assert (got - want).abs().max().item() < 1e-5  # seen: 1.2e-7
    g = torch.randn_like(got)
    (got * g).sum().backward()
    (want * g).sum().backward()
    linears = [m for m in bias.mlp.modules() if isinstance(m, nn.Linear)]
    for n, linear in enumerate(linears):
        torch.testing.assert_close(enc.weights[n].grad, linear.weight.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(enc.biases[n].grad, linear.bias.grad, rtol=1e-4, atol=1e-5)


def test_the_bias_depends_only_on_i_minus_j_and_is_signed():
    enc = dpb(causal=False, log_distance=True).double()
    with torch.no_grad():
        qp, kp = torch.arange(5, 11), torch.arange(0, 16)
        base = enc.bias(qp, kp)
        for shift in (1, 40, 5000):
            torch.testing.assert_close(enc.bias(qp + shift, kp + shift), base, rtol=0, atol=1e-12)
        # each pair reads f(j - i); a key 3 before and 3 after the query get different values
        for a, i in enumerate(qp.tolist()):
            torch.testing.assert_close(base[:, a], enc.relative_bias(kp - i))
        f = enc.relative_bias(torch.tensor([-3, 3]))
        assert (f[:, 0] - f[:, 1]).abs().min() > 1e-6
        # positions that skip values (randomized positions) take the general path: the same function
        qg, kg = torch.tensor([3, 9, 10, 40]), torch.tensor([0, 1, 3, 9, 10, 22, 40, 41])
        torch.testing.assert_close(enc.bias(qg, kg), enc.relative_bias(kg[None, :] - qg[:, None]))


def test_log_distance_feeds_sign_log1p():
    enc = dpb(depth=1, log_distance=True).double()
    plain = dpb(depth=1).double()
    plain.load_state_dict(enc.state_dict())
    r = torch.tensor([-20, -3, 0, 2, 7])
    x = -r.double()
    torch.testing.assert_close(enc.relative_bias(r), plain.mlp(torch.sign(x) * torch.log1p(x.abs())).T)
    torch.testing.assert_close(plain.relative_bias(r), plain.mlp(x).T)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("log_distance", [False, True])
def test_every_backend_agrees_with_eager(causal, log_distance):
    enc = dpb(causal, log_distance=log_distance)
    assert offers(enc, DistanceBias)
    check_backends(enc, causal, expect=("blocked", "sdpa"))


def test_cached_decoding_equals_the_full_pass():
    torch.manual_seed(0)
    model = posenc.LM(posenc.LMConfig(encoding="dpb", dim=32, depth=2, num_heads=4, vocab_size=64,
                                      encoding_options={"log_distance": True, "norm": True})).eval()
    assert_decoding_equals_full(model, backend="blocked")


def test_a_packed_row_equals_its_documents_alone():
    torch.manual_seed(0)
    model = posenc.LM(posenc.LMConfig(encoding="dpb", dim=32, depth=2, num_heads=4, vocab_size=50)).eval()
    tokens = torch.randint(0, 50, (1, 30))
    docs = torch.tensor([[0] * 12 + [1] * 7 + [2] * 11])
    with torch.no_grad():
        row = model(tokens, document_ids=docs)
        for lo, hi in ((0, 12), (12, 19), (19, 30)):
            torch.testing.assert_close(row[:, lo:hi], model(tokens[:, lo:hi]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("norm", [False, True])
def test_gradients_reach_every_parameter_of_the_mlp(norm):
    torch.manual_seed(0)
    model = posenc.LM(posenc.LMConfig(encoding="dpb", dim=32, depth=2, num_heads=4, vocab_size=50,
                                      encoding_options={"depth": 3, "norm": norm}))
    enc = model.blocks[0].attn.encoding
    assert enc is model.blocks[1].attn.encoding  # one MLP for every layer
    named = dict(enc.named_parameters())
    assert len(named) == 8 + (5 if norm else 0)  # 4 linears (weight, bias), 3 LayerNorm gains and 2 biases
    tokens = torch.randint(0, 50, (2, 24))
    torch.nn.functional.cross_entropy(model(tokens).reshape(-1, 50), tokens.reshape(-1)).backward()
    missing = [n for n, p in named.items() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, missing


def test_training_makes_no_quadratic_tensor():
    n = 1024
    largest, backend = largest_tensor("dpb", n=n)
    assert backend == "blocked"
    assert largest < n * n // 2, largest  # per-block (B, H, block, N) of blocked, not (H, N, N)


def test_bad_options_are_usage_errors():
    for options, name in (({"width": 0}, "width"), ({"depth": 0}, "depth"), ({"depth": 1.5}, "depth"),
                          ({"log_distance": 1}, "log_distance"), ({"norm": "yes"}, "norm")):
        with pytest.raises(UsageError, match=name):
            posenc.build("dpb", num_heads=H, head_dim=16, **options)
    assert posenc.build("dpb", num_heads=4, head_dim=16).width == 16  # default: a quarter of the model width
