"""Multi-head self-attention that calls the encoding's hooks and hands the rest to a backend.

The attention never tests an encoding's name: it calls ``rotate`` when the encoding has it, and the
backend asks the :class:`~posenc.backends.base.ScoreSpec` for bias and query/value terms.
``embed`` (absolute methods) is applied once by the model to the token embeddings, not here.
The KV cache (:class:`~posenc.cache.LayerCache`) lives in :mod:`posenc.cache`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from . import backends
from .backends.base import ScoreSpec
from .cache import LayerCache
from .encodings.base import check_positive
from .errors import UsageError
from .encodings.protocol import Rotates, offers
from .memo import ForwardMemo


def check_positions(positions: torch.Tensor, length: int, past: int | None = None) -> bool:
    """Validate ``positions`` for a sequence of ``length`` tokens; True when they are consecutive.

    Positions are a 1-D integer tensor of ``length`` distinct, increasing, non-negative values (a
    randomized-positions scheme may skip values; a KV cache needs them consecutive, continuing at
    ``past``). Anything else is a UsageError: a wrong length or order would otherwise silently give
    another attention than the one asked for.
    """
    if not isinstance(positions, torch.Tensor) or positions.dim() != 1 or positions.is_floating_point() or positions.is_complex():
        raise UsageError(f"positions must be a 1-D integer tensor, got {_describe(positions)}")
    if positions.numel() != length:
        raise UsageError(f"positions must hold one position per token ({length}), got {positions.numel()}")
    if length == 0:
        return True
    if int(positions[0]) < 0:
        raise UsageError(f"positions must be >= 0, got {int(positions.min())}")
    steps = positions[1:] - positions[:-1]
    if length > 1 and int(steps.min()) < 1:
        raise UsageError("positions must be strictly increasing (each token after the one before)")
    consecutive = int(positions[-1]) - int(positions[0]) == length - 1
    if past is not None and (not consecutive or int(positions[0]) != past):
        raise UsageError(
            f"with a KV cache, positions must continue the cache: {past}..{past + length - 1}, "
            f"got {int(positions[0])}..{int(positions[-1])}"
        )
    return consecutive


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dim()}-D {str(x.dtype).removeprefix('torch.')} tensor of shape {tuple(x.shape)}"
    return type(x).__name__


class Attention(nn.Module):
    """x (B, T, dim) -> (B, T, dim), with positions from ``encoding``.

    Args:
        dim: model width; must be divisible by ``num_heads``.
        num_heads: number of heads H; head dim D = dim // H.
        encoding: a positional encoding built for (num_heads, dim // num_heads), e.g.
            ``posenc.build("alibi", num_heads=8, head_dim=64)``.
        causal: mask keys after the query (decoder) or not (encoder).
        backend: "auto" or one of :func:`posenc.backends.names`.
    """

    def __init__(self, dim: int, num_heads: int, encoding: nn.Module, causal: bool = True, backend: str = "auto") -> None:
        super().__init__()
        check_positive("dim", dim)
        check_positive("num_heads", num_heads)
        if dim % num_heads:
            raise UsageError(f"dim ({dim}) must be divisible by num_heads ({num_heads})")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        if getattr(encoding, "num_heads", num_heads) != num_heads or getattr(encoding, "head_dim", self.head_dim) != self.head_dim:
            raise UsageError(
                f"encoding was built for num_heads={encoding.num_heads}, head_dim={encoding.head_dim}; "
                f"this attention has num_heads={num_heads}, head_dim={self.head_dim}"
            )
        if getattr(encoding, "causal", causal) != causal:
            raise UsageError(f"encoding was built with causal={encoding.causal}, attention has causal={causal}")
        self.causal = causal
        self.backend = backends.check_name(backend)
        # The registered name of the backend that ran the last forward ("auto" resolved): what
        # benchmarks and users read to know which path ran, without patching anything.
        self.last_backend: str | None = None
        self.encoding = encoding
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        memo: ForwardMemo | None = None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        past = 0 if cache is None else cache.length
        if cache is not None:
            cache.claim(self)
        if positions is None:
            positions = torch.arange(past, past + t, device=x.device)  # (T,)
            consecutive = True
        else:
            consecutive = check_positions(positions, t, past if cache is not None else None)
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, D)
        rotates = offers(self.encoding, Rotates)
        # A rotation that depends on the current length (dynamic NTK, LongRoPE's short/long switch)
        # must rotate every key with the current length: the cache keeps such keys un-rotated and
        # they are rotated here at each step (O(T x D) per step), so decoding equals the full pass.
        late = rotates and getattr(self.encoding, "rotation_depends_on_length", False)
        if rotates and not late:
            q, k = self.encoding.rotate(q, k, positions, positions)
        k_positions, starts, workspace = positions, None, None
        if cache is not None:
            k, v = cache.append(k, v)  # (B, H, past + T, D): views of the cache's buffers
            k_positions = cache.positions(x.device)  # 0..past+T-1, a view (nothing per step grows with N)
            starts, workspace = cache.starts(x.device), cache.workspace
        if late:
            # An encoding that keeps cached keys in a frame of its own (xPos's centre) rotates only the new ones.
            framed = cache is not None and callable(getattr(self.encoding, "rotate_in_frame", None))
            rotate = (lambda *a: self.encoding.rotate_in_frame(*a, cache)) if framed else self.encoding.rotate
            q, k = rotate(q, k, positions, k_positions)
        memo = ForwardMemo() if memo is None else memo
        spec = ScoreSpec(
            self.encoding, positions, k_positions, self.causal, 1.0 / math.sqrt(self.head_dim), memo, consecutive,
            starts, workspace,
        )
        self.last_backend, backend = backends.choose(self.backend, spec, q)
        out = backend.attend(q, k, v, spec)  # (B, H, T, D)
        return self.proj(out.transpose(1, 2).reshape(b, t, self.dim))
