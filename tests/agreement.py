"""Shared checks for the methods after ALiBi (imported by their test files, not collected itself).

``check_backends`` holds every registered backend that ``supports`` a call to the eager formula run
in float64: in float64 the backend must agree to 1e-9 (the algorithm is exact), and in float32 to
1e-5 on the output and the gradients of q, k and v, and to 1e-4 of their own scale on the encoding's
parameters (sums over B x N^2 pairs: float32 eager itself is ~1e-5 of its scale off).
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from posenc import backends
from posenc.backends import eager
from posenc.backends.parts.base import ScoreSpec
from posenc.call.memo import ForwardMemo

H, D = 4, 16
# (queries, keys): a full pass; a KV-cache step of 37 tokens; one decoded token; one block + 1.
CAUSAL_SHAPES = [(300, 300), (37, 300), (1, 300), (65, 65)]
ENCODER_SHAPES = [(300, 300), (65, 65)]


def run(attend, enc: nn.Module, q, k, v, spec: ScoreSpec, grad_out, dtype) -> list[torch.Tensor]:
    """Output and gradients of (q, k, v, *encoding parameters) in ``dtype``, returned in float64."""
    enc = copy.deepcopy(enc).to(dtype)
    spec = dataclasses.replace(spec, encoding=enc, memo=ForwardMemo())
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    out = attend(q, k, v, spec)
    params = [q, k, v, *enc.parameters()]
    grads = torch.autograd.grad(out, params, grad_out.to(dtype), allow_unused=True)
    return [out.double()] + [torch.zeros_like(p, dtype=torch.float64) if g is None else g.double() for p, g in zip(params, grads)]


def reference(enc, q, k, v, spec, grad_out) -> list[torch.Tensor]:
    """The eager formula, one block, float64."""
    return run(lambda *a: eager.attend(*a, block=10**6), enc, q, k, v, spec, grad_out, torch.float64)


def supporting(spec: ScoreSpec, q: torch.Tensor) -> list[str]:
    """Registered backends that can run this call with a gradient (never "eager" alone: it is the reference)."""
    with torch.enable_grad():
        return [name for name, b in backends.BACKENDS.items() if b.supports(spec, q.requires_grad_())]


def assert_agree(got: list[torch.Tensor], want: list[torch.Tensor], float64: bool, what: str = "") -> None:
    for n, (g, w) in enumerate(zip(got, want)):
        if float64:
            tol = 1e-9 * max(1.0, w.abs().max().item())
        else:
            tol = 1e-5 if n < 4 else 1e-4 * max(1.0, w.abs().max().item())
        torch.testing.assert_close(g, w, rtol=0, atol=tol, msg=lambda m: f"{what} tensor {n}: {m}")


def check_backends(enc: nn.Module, causal: bool, shapes=None, expect: tuple[str, ...] = ()) -> set[str]:
    """Every backend that supports ``enc`` agrees with eager on ``shapes``; returns the backends run.
    ``expect``: backends that must be among them."""
    shapes = shapes or (CAUSAL_SHAPES if causal else ENCODER_SHAPES)
    seen: set[str] = set()
    for tq, tk in shapes:
        torch.manual_seed(tq + tk)
        b = 1 if tq == 300 else 2
        q, k, v = torch.randn(b, H, tq, D), torch.randn(b, H, tk, D), torch.randn(b, H, tk, D)
        k_positions = torch.arange(5, 5 + tk)  # absolute positions need not start at 0
        spec = ScoreSpec(encoding=enc, q_positions=k_positions[tk - tq :], k_positions=k_positions, causal=causal, scale=1 / math.sqrt(D))
        grad_out = torch.randn(b, H, tq, D)
        want = reference(enc, q, k, v, spec, grad_out)
        for name in supporting(spec, q):
            attend = backends.BACKENDS[name].attend
            for dtype in (torch.float64, torch.float32):
                got = run(attend, enc, q, k, v, spec, grad_out, dtype)
                assert_agree(got, want, dtype == torch.float64, f"{name} {dtype} ({tq}, {tk}) causal={causal}")
            seen.add(name)
    assert set(expect) <= seen, (expect, seen)
    return seen


class MaxTensor(TorchDispatchMode):
    """Records the largest tensor (elements) any op returns. A dispatch mode sees this thread only;
    the kernel loops stay in it while one is active (posenc.backends.parts.denormals.flushed)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


class MaxStorage(MaxTensor):
    """Records the largest memory (elements) any op's output holds: a view counts its storage, not
    its shape, so a strided view of a small table (backends/parts/toeplitz.py's (1, H, N, N) mask
    over an (H, 2N - 1) table) counts as the table it reads."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.untyped_storage().nbytes() // max(t.element_size(), 1))
        return out


def largest_tensor(method: str, n: int = 1024, **options) -> tuple[int, str]:
    """The largest tensor of a forward + backward of one posenc.Attention layer at length n (auto
    backend, B=1, H=4, D=16), and the backend that ran."""
    import posenc
    from posenc.backends.parts import denormals

    enc = posenc.build(method, num_heads=H, head_dim=D, **options)
    layer = posenc.Attention(H * D, H, enc)
    x = torch.randn(1, n, H * D, requires_grad=True)
    was = denormals.FLUSHED.available
    denormals.FLUSHED.available = False  # the kernel loops run here, where the mode sees them
    try:
        with MaxTensor() as seen:
            layer(x).sum().backward()
    finally:
        denormals.FLUSHED.available = was
    return seen.largest, layer.last_backend


def check_flex_inference(enc: nn.Module) -> None:
    """FlexAttention (CPU, inference: compiled, ~5-15 s) agrees with eager on a cached step."""
    from posenc.backends import flex

    torch.manual_seed(6)
    q, k, v = torch.randn(1, H, 7, D), torch.randn(1, H, 40, D), torch.randn(1, H, 40, D)
    spec = ScoreSpec(encoding=enc, q_positions=torch.arange(33, 40), k_positions=torch.arange(40), causal=True, scale=0.25)
    with torch.no_grad():
        assert flex.supports(spec, q)
        torch.testing.assert_close(flex.attend(q, k, v, spec), eager.attend(q, k, v, spec), rtol=1e-5, atol=1e-5)


CHUNKINGS = ([1] * 20, [7, 1, 5, 7])  # token by token, and in uneven chunks, over 20 tokens


def decoded(model, tokens: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Logits of ``tokens`` (B, T) fed through a fresh KV cache ``chunks`` tokens at a time: what a
    cached decode gives, to compare with the full pass (B, T, vocab)."""
    cache, parts, at = model.new_cache(tokens.shape[0]), [], 0
    for n in chunks:
        parts.append(model(tokens[:, at : at + n], cache=cache))
        at += n
    return torch.cat(parts, 1)


def assert_decoding_equals_full(model, backend: str | None = None, length: int = 20) -> None:
    """Cached decoding (every chunking of :data:`CHUNKINGS`) gives the full pass's logits to 1e-5,
    on random tokens of two rows; ``backend``: the one the first layer's full pass must have used."""
    tokens = torch.randint(0, model.config.vocab_size, (2, length))
    with torch.no_grad():
        full = model(tokens)
        if backend is not None:
            assert model.blocks[0].attn.last_backend == backend
        for chunks in CHUNKINGS:
            torch.testing.assert_close(decoded(model, tokens, chunks), full, rtol=0, atol=1e-5)


def assert_packed_rows_equal_documents(attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``attn(x, document_ids=...)`` on two float64 rows of three documents (7, 2, 6 and 5, 5, 5
    tokens) equals each document run alone; returns the packed output (B, 15, dim)."""
    docs = torch.tensor([[0] * 7 + [1] * 2 + [2] * 6, [0] * 5 + [1] * 5 + [2] * 5])
    got = attn(x, document_ids=docs)
    for row, spans in ((0, ((0, 7), (7, 9), (9, 15))), (1, ((0, 5), (5, 10), (10, 15)))):
        for a, c in spans:
            torch.testing.assert_close(got[row : row + 1, a:c], attn(x[row : row + 1, a:c]), rtol=0, atol=1e-12)
    return got
