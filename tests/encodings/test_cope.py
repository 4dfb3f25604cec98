"""CoPE (Golovneva et al. 2024): the terms against a float64 re-derivation of the paper's equations
and, live, against x-transformers' ``CoPE`` (both scalings); the ``contextual`` backend (band and far
keys, widening, exactness whatever the gates), cache, memory and options."""

from __future__ import annotations

import math

import pytest
import torch
from x_transformers.attend import Attend
from x_transformers.x_transformers import CoPE as XCoPE

import posenc
from agreement import D, H, assert_decoding_equals_full, check_backends, largest_tensor, reference, run
from posenc.backends import contextual
from posenc.backends.parts.base import ScoreSpec
from posenc.errors import UsageError


def make(max_pos: int = 8, std: float = 0.3, **options) -> torch.nn.Module:
    enc = posenc.build("cope", num_heads=H, head_dim=D, max_pos=max_pos, **options)
    torch.nn.init.normal_(enc.pos_emb, std=std)  # zero at init: make the terms matter
    return enc


def formula(q, k, table, scale_positions: bool) -> torch.Tensor:
    """term_ij = (1 - w) z_i[floor p] + w z_i[ceil p], p = min(sum_{t=j..i} sigmoid(q_i.k_t / sqrt d),
    P - 1), z_i[p] = q_i . e[p] (/ sqrt d), for j <= i; 0 elsewhere. Loops, float64."""
    q, k, table = q.double(), k.double(), table.double()
    b_, h_, t, d = q.shape
    cap = table.shape[0] - 1
    out = torch.zeros(b_, h_, t, t, dtype=torch.float64)
    for b in range(b_):
        for h in range(h_):
            for i in range(t):
                z = [float(q[b, h, i] @ table[p]) / (math.sqrt(d) if scale_positions else 1) for p in range(cap + 1)]
                count = 0.0
                for j in range(i, -1, -1):
                    count += 1 / (1 + math.exp(-float(q[b, h, i] @ k[b, h, j]) / math.sqrt(d)))
                    p = min(count, cap)
                    w = p - math.floor(p)
                    out[b, h, i, j] = (1 - w) * z[math.floor(p)] + w * z[math.ceil(p)]
    return out


@pytest.mark.parametrize("scale_positions", [False, True])
def test_terms_are_the_papers_formula(scale_positions):
    torch.manual_seed(0)
    enc = make(max_pos=5, std=1.0, scale_positions=scale_positions).double()
    q, k = torch.randn(2, H, 12, D, dtype=torch.float64) * 2, torch.randn(2, H, 12, D, dtype=torch.float64) * 2
    pos = torch.arange(12)
    got = enc.query_terms(q, k, pos, pos)
    want = formula(q, k, enc.pos_emb, scale_positions)
    seen = torch.ones(12, 12, dtype=torch.bool).tril()
    torch.testing.assert_close(got[..., seen], want[..., seen], rtol=0, atol=1e-12)
    capped = q[..., 11, :] @ enc.pos_emb[4] / (math.sqrt(D) if scale_positions else 1)  # z_11[P - 1]
    assert (want[..., 11, 0] == capped).any()  # some counts reach the cap (and the test sees it)


def x_cope(enc) -> XCoPE:
    """x-transformers' CoPE holding our table (for the authors' scaling, the table / sqrt(d): the
    two differ only in that division of the position logits)."""
    xc = XCoPE(dim=D, heads=H, max_pos=enc.max_pos).to(enc.pos_emb.dtype)
    with torch.no_grad():
        xc.pos_emb.copy_(enc.pos_emb / (math.sqrt(D) if enc.scale_positions else 1.0))
    return xc


@pytest.mark.parametrize("scale_positions", [False, True])
def test_terms_match_x_transformers_live(scale_positions):
    torch.manual_seed(1)
    enc = make(max_pos=16, std=1.0, scale_positions=scale_positions).double()
    q, k = (torch.randn(2, H, 40, D, dtype=torch.float64) * 2 for _ in range(2))
    pos = torch.arange(40)
    sim = (q @ k.transpose(-1, -2)) / math.sqrt(D)
    future = torch.ones(40, 40, dtype=torch.bool).triu(1)
    want = x_cope(enc)(q, sim.masked_fill(future, -torch.finfo(sim.dtype).max))  # as its Attend calls it
    got = enc.query_terms(q, k, pos, pos)
    torch.testing.assert_close(got[..., ~future], want[..., ~future], rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", ["contextual", "eager"])
@pytest.mark.parametrize("scale_positions", [False, True])
def test_attention_matches_x_transformers_attend_live(backend, scale_positions):
    """Whole attention (softmax of logits plus terms, times v), outputs and gradients of q, k, v and
    the table: posenc's backends against x-transformers' Attend with CoPE, float64 both sides."""
    torch.manual_seed(2)
    enc = make(max_pos=6, std=0.5, scale_positions=scale_positions).double()
    q, k, v = (torch.randn(2, H, 150, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    xc = x_cope(enc)
    attend = Attend(causal=True, cope=xc, custom_attn_fn=lambda s: s.softmax(-1))  # its default softmax is float32
    want = attend(q, k, v)[0]
    grad = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, [q, k, v, xc.pos_emb], grad)
    pos = torch.arange(150)
    spec = ScoreSpec(encoding=enc, q_positions=pos, k_positions=pos, causal=True, scale=1 / math.sqrt(D))
    out = posenc.backends.BACKENDS[backend].attend(q, k, v, spec)
    grads = list(torch.autograd.grad(out, [q, k, v, enc.pos_emb], grad))
    grads[3] = grads[3] * (math.sqrt(D) if scale_positions else 1.0)  # d/d(table / sqrt d)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-10)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-9)


@pytest.mark.parametrize("scale_positions", [False, True])
def test_every_backend_agrees_with_eager(scale_positions):
    torch.manual_seed(3)
    seen = check_backends(make(scale_positions=scale_positions), True, expect=("contextual", "eager"))
    assert not seen & {"sdpa", "blocked", "flex", "features"}


def test_contextual_is_exact_whatever_the_gates(monkeypatch):
    """Gates near 0 for some rows (counts that never reach the cap: the band widens to the whole
    row), near 1 for others (the cap within a few keys); a small block so many blocks and groups."""
    monkeypatch.setattr(contextual, "BLOCK", 16)
    monkeypatch.setattr(contextual, "GROUP_ELEMENTS", 4 * 16 * 40)
    torch.manual_seed(4)
    enc = make(max_pos=8, std=1.0)
    n = 200
    q, k, v = torch.randn(1, H, n, D), torch.randn(1, H, n, D), torch.randn(1, H, n, D)
    k[:, :, :, 0] = 6.0
    q[:, 0, :, 0] = -6.0  # head 0: q.k ~ -36: gates ~ 1e-4, positions stay fractional all the way
    q[:, 1, :, 0] = 6.0  # head 1: gates ~ 1: the cap after 7 keys
    pos = torch.arange(n)
    spec = ScoreSpec(encoding=enc, q_positions=pos, k_positions=pos, causal=True, scale=1 / math.sqrt(D))
    widths = []
    original = contextual._forward

    def spy(*args):
        result = original(*args)
        widths.append(args[-1].width)  # the band width the call settled on
        return result

    monkeypatch.setattr(contextual, "_forward", spy)
    grad = torch.randn(1, H, n, D)
    for _ in range(2):
        got = run(contextual.attend, enc, q, k, v, spec, grad, torch.float64)
        want = reference(enc, q, k, v, spec, grad)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-9)
    assert widths[0] == n  # head 0 needs every key in the band
    q[:, :, :, 0] = 6.0  # now every head caps early: a narrow band
    got = run(contextual.attend, enc, q, k, v, spec, grad, torch.float32)
    want = reference(enc, q, k, v, spec, grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    assert widths[-1] < 40, widths


def test_auto_runs_contextual_without_a_quadratic_tensor():
    largest, backend = largest_tensor("cope", max_pos=16)
    assert backend == "contextual"
    assert largest < 1024 * 1024, largest


@pytest.mark.parametrize("options", [{"max_pos": 3}, {"max_pos": 16, "scale_positions": True}])
def test_cached_decoding_equals_full_pass(options):
    model = posenc.LM(posenc.LMConfig(encoding="cope", dim=32, depth=2, num_heads=4, encoding_options=options)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.3)
    assert model.blocks[0].attn.encoding is not model.blocks[1].attn.encoding  # one table per layer
    assert_decoding_equals_full(model, backend="contextual")


def test_zero_initialised_table_shared_by_heads():
    enc = posenc.build("cope", num_heads=H, head_dim=D)
    assert enc.pos_emb.shape == (16, D) and (enc.pos_emb == 0).all() and enc.max_pos == 16


@pytest.mark.parametrize(
    "options, message",
    [
        ({"max_pos": 0}, r"max_pos must be a positive integer \(>= 1\), got 0"),
        ({"scale_positions": "yes"}, "scale_positions must be True or False, got 'yes'"),
        ({"causal": False}, r"no bidirectional form; use causal=True"),
    ],
)
def test_bad_options_are_usage_errors(options, message):
    with pytest.raises(UsageError, match=message):
        posenc.build("cope", num_heads=2, head_dim=4, **options)


def test_eager_and_contextual_agree_through_the_model():
    torch.manual_seed(5)
    config = dict(encoding="cope", dim=64, depth=2, num_heads=4, encoding_options={"max_pos": 8})
    fast = posenc.LM(posenc.LMConfig(**config))
    slow = posenc.LM(posenc.LMConfig(**config, attention_backend="eager"))
    with torch.no_grad():
        for p in fast.parameters():
            p.normal_(std=0.1)
    slow.load_state_dict(fast.state_dict())
    tokens = torch.randint(0, 256, (1, 300))
    outs = []
    for model in (fast, slow):
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())
        outs.append([loss.detach(), *torch.autograd.grad(loss, list(model.parameters()))])
    assert fast.blocks[0].attn.last_backend == "contextual" and slow.blocks[0].attn.last_backend == "eager"
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_the_formula_test_can_fail():
    """The re-derivation sees the difference between the two scalings."""
    torch.manual_seed(6)
    enc = make(max_pos=5, std=1.0).double()
    q, k = (torch.randn(1, H, 6, D, dtype=torch.float64) * 2 for _ in range(2))
    pos = torch.arange(6)
    assert (enc.query_terms(q, k, pos, pos) - formula(q, k, enc.pos_emb, True)).tril().abs().max() > 1e-2
