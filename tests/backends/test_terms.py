"""The ``terms`` backend (backends/terms.py) against the eager formula: Shaw and
Transformer-XL, outputs and every gradient, causal and bidirectional, with a KV cache."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from posenc.backends import eager
from posenc.backends import terms as terms
from posenc.backends.parts import distance
from posenc.backends.parts.base import ScoreSpec
from posenc.encodings.shaw import Shaw
from posenc.encodings.transformer_xl import TransformerXL

H, D = 2, 8


def make(method: str, causal: bool, dtype=torch.float32, clip: int = 8):
    enc = Shaw(H, D, causal=causal, max_relative_position=clip) if method == "shaw" else TransformerXL(H, D, causal=causal)
    with torch.no_grad():
        for p in enc.parameters():  # large enough that the position terms matter
            p.normal_(0.0, 0.5)
    return enc.to(dtype)


def qkv(tq: int, tk: int, dtype=torch.float32, batch: int = 2):
    return tuple(torch.randn(batch, H, n, D, dtype=dtype) for n in (tq, tk, tk))


def spec_for(enc, tq: int, tk: int, causal: bool, start: int = 5) -> ScoreSpec:
    k_positions = torch.arange(start, start + tk)
    return ScoreSpec(encoding=enc, q_positions=k_positions[tk - tq :], k_positions=k_positions, causal=causal, scale=1.0 / math.sqrt(D))


def run(backend, enc, q, k, v, spec, grad_out):
    """Output and the gradients of q, k, v and every parameter, for one backend."""
    enc.zero_grad()
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = backend.attend(q, k, v, spec)
    (out * grad_out).sum().backward()
    return {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad, **{n: p.grad.clone() for n, p in enc.named_parameters()}}


def assert_agree(ref: dict, got: dict, tol: float = 1e-5):
    assert ref.keys() == got.keys()
    for name in ref:
        scale = max(1.0, ref[name].abs().max().item())
        err = (ref[name] - got[name]).abs().max().item()
        assert err <= tol * scale, f"{name}: max error {err:.2e} (scale {scale:.2f})"


@pytest.mark.parametrize("method", ["shaw", "transformer_xl"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "tq, tk",
    [
        (200, 200),  # several blocks and band chunks, far region on both sides
        (37, 37),  # odd length, last block partial
        (1, 1),
        (9, 9),  # shorter than the band: no far region
        (1, 61),  # decoding one token after a KV cache
        (13, 61),  # a chunk of tokens after a KV cache
        (60, 61),
    ],
)
def test_agrees_with_eager(method, causal, tq, tk, monkeypatch):
    monkeypatch.setattr(distance, "XL_BLOCK", 16)
    monkeypatch.setattr(terms, "SHAW_CHUNK", 8)
    enc = make(method, causal)
    spec = spec_for(enc, tq, tk, causal)
    assert terms.preferred(spec, torch.empty(0))
    q, k, v = qkv(tq, tk)
    grad_out = torch.randn(2, H, tq, D)
    assert_agree(run(eager, enc, q, k, v, spec, grad_out), run(terms, enc, q, k, v, spec, grad_out))


@pytest.mark.parametrize("block, heads, chunk", [(1, 2, 8), (7, 2, 8), (64, 1, 40), (128, 2, 1)])
def test_block_sizes_do_not_matter(block, heads, chunk, monkeypatch):
    """Tiles of one query, odd tiles, tiles of some of the heads (batch of 2), band chunks."""
    monkeypatch.setattr(distance, "XL_BLOCK", block)
    monkeypatch.setattr(distance, "XL_HEADS", heads)
    monkeypatch.setattr(terms, "SHAW_CHUNK", chunk)
    for method in ("shaw", "transformer_xl"):
        for causal in (True, False):
            enc = make(method, causal, clip=3)
            spec = spec_for(enc, 45, 50, causal)
            q, k, v = qkv(45, 50)
            grad_out = torch.randn(2, H, 45, D)
            assert_agree(run(eager, enc, q, k, v, spec, grad_out), run(terms, enc, q, k, v, spec, grad_out))


class Call(torch.nn.Module):
    """The backend as a module of the encoding's parameters, for ``functional_call``."""

    def __init__(self, enc, spec):
        super().__init__()
        self.enc, self.spec = enc, spec

    def forward(self, q, k, v):
        return terms.attend(q, k, v, self.spec)


@pytest.mark.parametrize("method", ["shaw", "transformer_xl"])
@pytest.mark.parametrize("causal", [True, False])
def test_gradcheck_float64(method, causal, monkeypatch):
    """The custom autograd functions' gradients against finite differences, parameters included."""
    monkeypatch.setattr(distance, "XL_BLOCK", 5)
    monkeypatch.setattr(terms, "SHAW_CHUNK", 4)
    enc = make(method, causal, torch.float64, clip=2)
    tq, tk = 9, 12
    call = Call(enc, spec_for(enc, tq, tk, causal))
    names = [n for n, _ in call.named_parameters()]
    assert terms.preferred(call.spec, torch.empty(0, dtype=torch.float64))

    def f(q, k, v, *params):
        return torch.func.functional_call(call, dict(zip(names, params)), (q, k, v))

    inputs = (*qkv(tq, tk, torch.float64, batch=1), *(p.detach().clone() for p in call.parameters()))
    assert torch.autograd.gradcheck(f, tuple(t.requires_grad_() for t in inputs), eps=1e-6, atol=1e-6, fast_mode=True)


def test_far_region_shares_the_clipped_vectors():
    """a^V_{-k} serves every key at distance k or more: changing it moves exactly the rows that
    have such keys (the far part is not dropped), and the result still matches eager."""
    enc = make("shaw", True, clip=2)
    spec = spec_for(enc, 40, 40, True)
    q, k, v = qkv(40, 40)
    before = terms.attend(q, k, v, spec)
    with torch.no_grad():
        enc.value_table[0] += 1.0
    after = terms.attend(q, k, v, spec)
    change = (after - before).abs().amax(dim=-1)  # (B, H, T)
    assert change[..., :2].max() == 0  # rows 0, 1: no key at distance 2 or more
    assert change[..., 2:].min() > 0  # the others: key 0 at distance >= 2 uses row 0
    torch.testing.assert_close(after, eager.attend(q, k, v, spec), rtol=1e-5, atol=1e-5)


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an aten op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("method", ["shaw", "transformer_xl"])
@pytest.mark.parametrize("causal", [True, False])
def test_no_quadratic_tensor(method, causal, monkeypatch):
    """Forward and backward at N=512: no tensor near B*H*N*N elements (eager makes several)."""
    monkeypatch.setattr(distance, "XL_BLOCK", 32)
    monkeypatch.setattr(distance, "XL_HEADS", 2)
    n = 512
    enc = make(method, causal)
    spec = spec_for(enc, n, n, causal)
    q, k, v = (t.requires_grad_() for t in qkv(n, n, batch=1))
    with LargestTensor() as mode:
        terms.attend(q, k, v, spec).sum().backward()
    quadratic = H * n * n
    assert mode.largest <= quadratic // 6, f"largest tensor {mode.largest} elements, H*N*N = {quadratic}"
    with LargestTensor() as mode:
        eager.attend(q, k, v, spec).sum().backward()
    assert mode.largest >= quadratic // 2  # the check can see a quadratic tensor


def test_falls_back_to_eager_when_not_fast():
    enc = make("shaw", True)
    spec = spec_for(enc, 10, 10, True)
    assert terms.supports(spec, torch.empty(0))
    assert not terms.preferred(spec, torch.empty(0, dtype=torch.bfloat16))
    q, k, v = qkv(10, 10, torch.bfloat16)
    torch.testing.assert_close(terms.attend(q, k, v, spec), eager.attend(q, k, v, spec))
    # Queries outside the keys' positions: eager's result, not the fast path's assumptions.
    odd = ScoreSpec(encoding=enc, q_positions=torch.arange(20, 30), k_positions=torch.arange(0, 10), causal=True, scale=1.0 / math.sqrt(D))
    assert not terms.preferred(odd, torch.empty(0))
    q, k, v = qkv(10, 10)
    torch.testing.assert_close(terms.attend(q, k, v, odd), eager.attend(q, k, v, odd), equal_nan=True)


@pytest.mark.parametrize("method", ["shaw", "transformer_xl"])
def test_auto_picks_terms_and_decoding_matches_full_pass(method):
    """Through ``Attention``: auto selects this backend on CPU, and decoding token by token and
    in chunks with a KV cache gives the full pass's outputs (computed by eager)."""
    from posenc import backends
    from posenc.model.attention import Attention, LayerCache

    enc = make(method, True, clip=3)
    spec = spec_for(enc, 10, 10, True)
    assert backends.choose("auto", spec, torch.empty(1, H, 10, D)) == ("terms", terms)
    fast = Attention(H * D, H, enc, causal=True, backend="auto")
    slow = Attention(H * D, H, enc, causal=True, backend="eager")
    slow.load_state_dict(fast.state_dict())
    x = torch.randn(2, 23, H * D)
    with torch.no_grad():
        full = slow(x)
        cache, steps = LayerCache(), []
        for t0, t1 in [(0, 9), (9, 10), (10, 11), (11, 23)]:
            steps.append(fast(x[:, t0:t1], cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
