"""Fourier Position Embedding, FoPE (Hua et al. 2024, "Fourier Position Embedding: Enhancing
Attention's Periodic Extension for Length Generalization", arXiv 2412.17739, §4), in the form
vLLM serves it for an Intern model (``FourierRotaryEmbedding``: learned coefficients per key head).

RoPE (:mod:`.rope`) turns pair d of q and k by one frequency, ``cos(n omega_d)`` and
``sin(n omega_d)``. FoPE makes every pair a Fourier series over the frequencies the model can learn
(§4, "Fourier Series"): with ``omega_0 > .. > omega_(M-1)`` the kept frequencies,

    c_(h,d)(n) = sum_e C[h, e, d] cos(n omega_e)        s_(h,d)(n) = sum_e S[h, e, d] sin(n omega_e)
    y_d        = x_d c_(h,d)(n) - x_(d+F) s_(h,d)(n)
    y_(d+F)    = x_(d+F) c_(h,d)(n) + x_d s_(h,d)(n)                    (half layout, F = D/2)

with learned cosine and sine coefficients C, S (Hkv, M, M), one set per key head (a query head
uses its group's key head's, as grouped-query attention pairs them). C = S = I is RoPE. The
frequencies whose period exceeds the training length L, ``omega < 2 pi / L``, never turn a full
cycle in training (§4, "Clipping Floor Frequencies"): they are dropped from the basis and their
pairs get the zero frequency, ``c = 1, s = 0`` (not rotated). ``omega_k = base^(-2k/D)``; M = the
number of k with ``omega_k >= 2 pi / L`` (vLLM: ``> 2 pi / L``; equal only on a measure-zero
boundary), or ``num_frequencies`` (vLLM's ``num_inv_freq``), or D/2 without either.

**vLLM's padding.** vLLM pads the pairs past M with ``F.pad(..., value=1)`` for cos *and* sin, so
those pairs get ``c = s = 1`` (a fixed shear, not the zero frequency); ``padding="vllm"`` reproduces
that for a checkpoint served that way, ``"zero"`` (default) is the paper's.

**Checkpoint layout** (``state_dict``): ``cos_coef`` and ``sin_coef``, float (Hkv, M, M), indexed
``[key head, input frequency e, output pair d]``: vLLM's ``rotary_emb.cos_coef`` / ``sin_coef``
as they are. :meth:`FoPE.load_coefficients` also takes the shared (M, M) form (vLLM's
``fope_sep_head=False``) and checks the shapes.

Initialisation: C and S have 1 on the diagonal (each pair's dominant frequency) and every other
entry drawn from N(0, (sigma / sqrt(M))^2) (the paper's weaker random harmonics; sigma 0.3 at its
smallest scale), from torch's global generator.

Precision: cos and sin of float64 angles of integer positions, rounded once to float32 (RoPE's
table); the mixing and the rotation in float32 (float64 for float64 inputs), cast back once.

Shape legend: B batch, H query heads, Hkv key heads, T length, D head dim, F = D/2 pairs, M kept
frequencies.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import UsageError, check_positive
from .base import PositionalEncoding
from .rope import RotaryTable, check_rotation_inputs
from .rope_scaling import default_frequencies

PADDINGS = ("zero", "vllm")


class FoPE(PositionalEncoding):
    """FoPE: every rotated pair a learned Fourier series over the kept RoPE frequencies.

    Args:
        base: theta base of ``omega_k = base^(-2k/D)`` (default 10000).
        train_length: L: frequencies below 2 pi / L are dropped (zero frequency); None: none dropped.
        num_frequencies: keep the first M frequencies instead (vLLM's ``num_inv_freq``); not with
            ``train_length``.
        num_kv_heads: key heads of grouped-query attention (default num_heads): one coefficient set
            each, shared by its group's query heads.
        sigma: std scale of the initial off-diagonal coefficients (std sigma / sqrt(M)); 0: RoPE.
        padding: the pairs past M: "zero" (cos 1, sin 0: the paper) or "vllm" (cos 1, sin 1).
        cache_length: initial rows of the cos/sin table of the kept frequencies (grows as needed).

    Raises:
        UsageError: an odd head_dim, a base outside (1, 1e12], a non-positive train_length or
            num_frequencies (or both given, or num_frequencies above D/2), num_kv_heads not dividing
            num_heads, a negative sigma, an unknown padding, or a train_length that drops every
            frequency.
    """

    name = "fope"
    description = "each rotated pair a learned Fourier series over RoPE's frequencies, floor frequencies zeroed (Hua et al. 2024)"
    extrapolates = True
    shift_invariant = False  # the series mix frequencies: scores are not functions of i - j alone
    cos_coef: nn.Parameter
    sin_coef: nn.Parameter

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        causal: bool = True,
        base: float = 10000.0,
        train_length: int | None = None,
        num_frequencies: int | None = None,
        num_kv_heads: int | None = None,
        sigma: float = 0.3,
        padding: str = "zero",
        cache_length: int = 2048,
    ) -> None:
        super().__init__(num_heads, head_dim, causal)
        if head_dim % 2:
            raise UsageError(f"fope needs an even head_dim, got {head_dim}")
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not 1 < base <= 1e12:
            raise UsageError(f"base must be a finite number in (1, 1e12], got {base!r}")
        if train_length is not None and num_frequencies is not None:
            raise UsageError("give train_length or num_frequencies (the kept frequencies), not both")
        kv = num_heads if num_kv_heads is None else check_positive("num_kv_heads", num_kv_heads)
        if num_heads % kv:
            raise UsageError(f"num_kv_heads must divide num_heads={num_heads}, got {kv}")
        if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not math.isfinite(sigma) or sigma < 0:
            raise UsageError(f"sigma must be a finite number >= 0, got {sigma!r}")
        if padding not in PADDINGS:
            raise UsageError(f"padding must be one of {PADDINGS}, got {padding!r}")
        half = head_dim // 2
        omega = default_frequencies(float(base), head_dim)  # (F,) float64, descending
        if train_length is not None:
            floor = 2 * math.pi / check_positive("train_length", train_length)
            kept = int((omega >= floor).sum())
            if kept == 0:
                raise UsageError(f"train_length={train_length} drops every frequency (the fastest, 1, is below 2 pi / L); "
                                 "it must be at least 7")
        elif num_frequencies is not None:
            kept = check_positive("num_frequencies", num_frequencies)
            if kept > half:
                raise UsageError(f"num_frequencies must be in [1, head_dim/2 = {half}], got {num_frequencies}")
        else:
            kept = half
        self.base, self.train_length, self.num_kv_heads = float(base), train_length, kv
        self.num_frequencies, self.sigma, self.padding = kept, float(sigma), padding
        self._table = RotaryTable(omega[:kept].to(torch.float32), check_positive("cache_length", cache_length))
        noise = torch.randn(2, kv, kept, kept, dtype=torch.float64) * (sigma / math.sqrt(kept))  # (2, Hkv, M, M)
        init = noise * (1 - torch.eye(kept, dtype=torch.float64)) + torch.eye(kept, dtype=torch.float64)
        self.cos_coef = nn.Parameter(init[0].to(torch.float32))  # (Hkv, M, M): [head, input e, output d]
        self.sin_coef = nn.Parameter(init[1].to(torch.float32))

    @property
    def inv_freq(self) -> torch.Tensor:
        """float32 (M,) the kept frequencies omega_0 > .. > omega_(M-1)."""
        return self._table.inv_freq

    def load_coefficients(self, cos_coef: torch.Tensor, sin_coef: torch.Tensor) -> None:
        """Copy a checkpoint's coefficients in: (Hkv, M, M) each, or (M, M) shared by every key head.

        Raises:
            UsageError: another shape, or values that are not finite.
        """
        m, kv = self.num_frequencies, self.num_kv_heads
        for label, given, param in (("cos_coef", cos_coef, self.cos_coef), ("sin_coef", sin_coef, self.sin_coef)):
            if not isinstance(given, torch.Tensor) or tuple(given.shape) not in ((kv, m, m), (m, m)):
                shape = tuple(given.shape) if isinstance(given, torch.Tensor) else type(given).__name__
                raise UsageError(f"{label} must have shape ({kv}, {m}, {m}) (key heads, kept frequencies, pairs) or "
                                 f"({m}, {m}) (shared), got {shape}")
            if not bool(torch.isfinite(given).all()):
                raise UsageError(f"{label} must be finite")
            with torch.no_grad():
                param.copy_(given.expand(kv, m, m))

    def series(self, positions: torch.Tensor, length: int | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """c, s (Hkv, T, F) in ``dtype`` at ``positions`` (T,): the kept pairs' series, the rest padded.
        ``length`` None (compiling): the table as built, ``cache_length`` rows, as RoPE's compiled path."""
        table = self._table
        if length is None:
            if table.cos.device != positions.device:
                table.build(table.length, positions.device)
            cos, sin = table.cos[positions], table.sin[positions]  # (T, M) float32
        else:
            cos, sin = table.lookup(positions, max(length, 1))  # (T, M) float32
        c = torch.einsum("te,hed->htd", cos.to(dtype), self.cos_coef.to(dtype))  # (Hkv, T, M)
        s = torch.einsum("te,hed->htd", sin.to(dtype), self.sin_coef.to(dtype))  # (Hkv, T, M)
        pad = self.head_dim // 2 - self.num_frequencies
        if pad:
            c = nn.functional.pad(c, (0, pad), value=1.0)
            s = nn.functional.pad(s, (0, pad), value=1.0 if self.padding == "vllm" else 0.0)
        return c, s

    def _turn(self, x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, label: str) -> torch.Tensor:
        heads = x.shape[1]
        if heads not in (self.num_heads, self.num_kv_heads):
            raise UsageError(f"fope: {label} has {heads} heads; the encoding was built for num_heads={self.num_heads} "
                             f"and num_kv_heads={self.num_kv_heads}")
        if heads != self.num_kv_heads:  # a query head uses its group's key head's series
            c = c.repeat_interleave(heads // self.num_kv_heads, dim=0)
            s = s.repeat_interleave(heads // self.num_kv_heads, dim=0)
        f = self.head_dim // 2
        xf = x.to(c.dtype)
        x1, x2 = xf[..., :f], xf[..., f:]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)  # (B, heads, T, D)

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B, H, Tq, D), k (B, Hkv or H, Tk, D) at 1-D positions -> the same shapes."""
        # Compiled: nothing read on the host (no graph break); the table's indexing checks the bounds.
        length = None if torch.compiler.is_compiling() else check_rotation_inputs(self, q, k, q_positions, k_positions)[1]
        dtype = torch.float64 if torch.float64 in (q.dtype, self.cos_coef.dtype) else torch.float32
        cq, sq = self.series(q_positions, length, dtype)
        ck, sk = self.series(k_positions, length, dtype)
        return self._turn(q, cq, sq, "q"), self._turn(k, ck, sk, "k")

    def extra_repr(self) -> str:
        kv = "" if self.num_kv_heads == self.num_heads else f", num_kv_heads={self.num_kv_heads}"
        return (f"{super().extra_repr()}, base={self.base}, num_frequencies={self.num_frequencies}, "
                f"train_length={self.train_length}{kv}, padding={self.padding!r}")


__all__ = ["FoPE", "PADDINGS"]
