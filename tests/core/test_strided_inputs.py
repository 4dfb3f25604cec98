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
from posenc.encodings.protocol import Gates, offers
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
