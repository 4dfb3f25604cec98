"""Values with another head dim than queries and keys (Dv != D, as in DeepSeek's multi-head latent
attention): every method equals the eager formula in float64, forward and backward, in one call,
with grouped heads and in a packed row; and the CPU flash kernel runs the call (zero features on
the narrower side) instead of the formula in row blocks."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.profiler import profile

import posenc
from posenc.backends.parts.regions import FLASH_OPS
from posenc.errors import UsageError

pytestmark = pytest.mark.usefixtures("one_thread")

H, HKV, T, D = 4, 2, 40, 16
METHODS = ["nope", "rope", "alibi", "t5", "kerple", "fire", "transformer_xl", "cope", "sandwich", "xpos", "deberta"]
FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"


def inputs(dv: int, hkv: int = H, b: int = 2):
    g = torch.Generator().manual_seed(dv + hkv)
    q = torch.randn(b, H, T, D, generator=g)
    k, v = torch.randn(b, hkv, T, D, generator=g), torch.randn(b, hkv, T, dv, generator=g)
    return [x.requires_grad_() for x in (q, k, v)]


def grads(out: torch.Tensor, xs, g_out: torch.Tensor):
    return torch.autograd.grad(out, xs, g_out)


def check(method: str, dv: int, hkv: int = H, **call) -> None:
    torch.manual_seed(0)
    enc = posenc.build(method, num_heads=H, head_dim=D) if method != "nope" else None
    xs = inputs(dv, hkv, b=1 if "document_ids" in call else 2)
    out = posenc.attend(*xs, enc, **call)
    assert out.shape == (*xs[0].shape[:3], dv)
    g_out = torch.randn_like(out)
    ref_enc = None if enc is None else copy.deepcopy(enc).double()
    ref_xs = [x.detach().double().requires_grad_() for x in xs]
    ref = posenc.attend(*ref_xs, ref_enc, backend="eager", **call)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    for got, want in zip(grads(out, xs, g_out), grads(ref, ref_xs, g_out.double())):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("dv", [8, 24])
@pytest.mark.parametrize("method", METHODS)
def test_equals_the_formula(method: str, dv: int) -> None:
    check(method, dv)


@pytest.mark.parametrize("dv", [8, 24])
def test_value_terms_need_the_query_head_dim(dv: int) -> None:
    """Shaw adds relative value vectors of q's head dim to the output: another Dv is refused."""
    with pytest.raises(UsageError) as err:
        posenc.attend(*inputs(dv), posenc.build("shaw", num_heads=H, head_dim=D))
    assert str(err.value) == ("v must have q's head_dim (16) with Shaw: its relative value vectors, added to the "
                              f"output, have that width; got {dv}")


@pytest.mark.parametrize("method", ["nope", "rope", "alibi", "t5", "fire"])
def test_grouped_heads_and_a_packed_row(method: str) -> None:
    check(method, 8, hkv=HKV)
    check(method, 24, hkv=HKV, document_ids=torch.tensor([[0] * 15 + [1] * 25]))


@pytest.mark.skipif(not FLASH_OPS, reason="this torch has no CPU flash ops")
@pytest.mark.parametrize("method", ["nope", "rope", "alibi", "t5"])
@pytest.mark.parametrize("dv", [8, 24])
def test_the_flash_kernel_runs_the_call(method: str, dv: int) -> None:
    enc = posenc.build(method, num_heads=H, head_dim=D) if method != "nope" else None
    q, k, v = inputs(dv)
    with profile() as prof:
        posenc.attend(q, k, v, enc).sum().backward()
    names = {e.key for e in prof.key_averages()}  # (a bias method's backward runs on posenc's flushing thread)
    assert FLASH in names and (method in ("alibi", "t5") or f"{FLASH}_backward" in names), sorted(names)
    assert not any("math" in n for n in names), sorted(n for n in names if "attention" in n)
