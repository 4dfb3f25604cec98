"""Property: strided, transposed, expanded and sliced q/k/v give what their contiguous copies give,
for every registered encoding through every backend that runs the call, against the eager backend
(the textbook formula) on contiguous inputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import posenc
from posenc import backends
from posenc.encodings import get_class, options_of
from posenc.encodings.protocol import Curves, Gates, offers
from posenc.errors import UsageError

pytestmark = pytest.mark.usefixtures("one_thread")

H, D = 2, 8
KINDS = ("transposed", "sliced", "expanded", "permuted")


def strided(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x's values in a layout of ``kind``: a (.., D, T) tensor read transposed, every other feature
    of a wider one, a length-1 tensor expanded (its values repeated), a (B, T, H, D) one permuted."""
    if kind == "transposed":
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "sliced":
        return torch.stack([x, torch.zeros_like(x)], -1).flatten(-2)[..., ::2]
    if kind == "expanded":
        return x[:, :, :1].expand_as(x)
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def case(method: str, seed: int, length: int):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, H, length, D, generator=g) for _ in range(3))
    enc = posenc.build(method, num_heads=H, head_dim=D)
    extra = {"log_gates": -torch.rand(1, H, length, generator=g)} if offers(enc, Gates) else {}
    if offers(enc, Curves):  # the Inkling bias: curves over 5 distances from the (absent) layer input
        extra = {"query_curves": torch.randn(1, H, length, 5, generator=g)}
    return q, k, v, enc, extra


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10_000), length=st.integers(1, 24), which=st.integers(0, 2), kind=st.sampled_from(KINDS))
@pytest.mark.parametrize("method", [m for m in posenc.available() if m != "axial_rope"])
def test_strided_equals_contiguous_on_every_backend(method: str, seed: int, length: int, which: int, kind: str) -> None:
    q, k, v, enc, extra = case(method, seed, length)
    inputs = [q, k, v]
    inputs[which] = strided(inputs[which], kind)
    contiguous = [x.contiguous() for x in inputs]
    reference = posenc.attend(*contiguous, enc, backend="eager", **extra)
    for name in backends.names():
        try:
            out = posenc.attend(*inputs, enc, backend=name, **extra)
        except UsageError:  # a forced backend that cannot run this call says so
            continue
        assert torch.allclose(out, reference, atol=1e-5), name


@pytest.mark.parametrize("kv_heads", [H, 1])
@pytest.mark.parametrize("method", [m for m in posenc.available() if m != "axial_rope"])
def test_heads_first_memory_equals_contiguous_forward_and_backward(method: str, kv_heads: int) -> None:
    """q, k, v (B, H, T, D) held in (H, B, T, D) memory, as a packed head-major row's documents are
    stacked: output and gradients (inputs' and parameters') equal the contiguous inputs' on every
    backend that runs the call, against the eager backend."""
    g = torch.Generator().manual_seed(1)
    b, t = 3, 20
    heads_first = [torch.randn(hh, b, t, D, generator=g, dtype=torch.float64).transpose(0, 1) for hh in (H, kv_heads, kv_heads)]
    grouped = {"num_kv_heads": kv_heads} if "num_kv_heads" in options_of(get_class(method)) else {}
    enc = posenc.build(method, num_heads=H, head_dim=D, **grouped).double()
    extra = {"log_gates": -torch.rand(b, H, t, generator=g, dtype=torch.float64)} if offers(enc, Gates) else {}
    if offers(enc, Curves):
        extra = {"query_curves": torch.randn(b, H, t, 5, generator=g, dtype=torch.float64)}
    w = torch.randn(b, H, t, D, generator=g, dtype=torch.float64)

    def grads(inputs: list[torch.Tensor], backend: str) -> list[torch.Tensor]:
        xs = [x.detach().requires_grad_() for x in inputs]
        params = [p for p in enc.parameters() if p.requires_grad]
        out = posenc.attend(*xs, enc, backend=backend, **extra)
        return [out, *torch.autograd.grad((out * w).sum(), xs + params, allow_unused=True)]

    reference = grads([x.contiguous() for x in heads_first], "eager")
    ran = 0
    for name in backends.names():
        try:
            got = grads(heads_first, name)
        except UsageError:  # a forced backend that cannot run this call says so
            continue
        ran += 1
        for a, r in zip(got, reference):
            assert (a is None) == (r is None), name
            if a is not None:
                torch.testing.assert_close(a, r, atol=1e-9, rtol=1e-7, msg=name)
    assert ran >= 2
