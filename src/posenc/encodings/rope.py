"""Rotary position embedding, RoPE (Su et al. 2021, "RoFormer", §3.4).

Queries and keys are rotated, pair of features by pair of features, by the angle ``pos * theta_k``
with ``theta_k = base^(-2k/d)``; the dot product of a rotated query and key then depends on the
content and on ``i - j`` only. Two feature layouts are in use, the same function up to a
permutation of q/k features:

- ``layout="half"``: feature k pairs with feature k + d/2 (GPT-NeoX, Hugging Face LLaMA);
- ``layout="interleaved"``: feature 2k pairs with 2k + 1 (the RoFormer paper, GPT-J).

``rotary_dim`` < head_dim rotates only the first ``rotary_dim`` features (partial rotary, GPT-J and
GPT-NeoX). The cos/sin tables are built in float32 from integer positions whatever the input
dtype, so every position up to 2^24 gets its own exact angle even for bfloat16 inputs; the rotation
itself is computed in float32 and cast back.
"""

from __future__ import annotations

import torch

from .base import PositionalEncoding, check_positive

LAYOUTS = ("half", "interleaved")


class RoPE(PositionalEncoding):
    """Rotary embedding of q and k with an explicit, growable cos/sin cache."""

    name = "rope"
    description = "rotates q and k by position-dependent angles (Su et al. 2021, RoFormer)"
    extrapolates = True  # runs at any length, degrading past the training length
    shift_invariant = True  # depends on i - j only (rotation_depends_on_length switches it off)

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        causal: bool = True,
        base: float = 10000.0,
        layout: str = "half",
        rotary_dim: int | None = None,
        cache_length: int = 2048,
    ) -> None:
        super().__init__(num_heads, head_dim, causal)
        if head_dim % 2:
            raise ValueError(f"rope needs an even head_dim, got {head_dim}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or not 2 <= rotary_dim <= head_dim or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be an even integer in [2, head_dim={head_dim}], got {rotary_dim!r}")
        if not base > 1:
            raise ValueError(f"base must be > 1, got {base}")
        self.base = float(base)
        self.layout = layout
        self.rotary_dim = rotary_dim
        self.register_buffer("inv_freq", self._inv_freq(torch.device("cpu")), persistent=False)  # (d/2,)
        self.register_buffer("cos_cached", torch.empty(0, rotary_dim // 2), persistent=False)
        self.register_buffer("sin_cached", torch.empty(0, rotary_dim // 2), persistent=False)
        self.build_cache(check_positive("cache_length", cache_length))

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        """theta_k = base^(-2k/d), rounded once to float32 (the frequencies checkpoints use)."""
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float64, device=device) / self.rotary_dim
        return (self.base ** -exponents).to(torch.float32)

    def build_cache(self, max_len: int) -> None:
        """(Re)build the float32 cos/sin tables for positions 0..max_len-1."""
        device = self.inv_freq.device
        # Recomputed rather than read from the buffer: `module.to(bfloat16)` casts buffers too,
        # and the tables must stay float32 whatever the model's dtype.
        self.inv_freq = self._inv_freq(device)
        # float64 angles, rounded once to float32: the most accurate table float32 can hold.
        positions = torch.arange(max_len, dtype=torch.float64, device=device)
        angles = positions[:, None] * self.inv_freq.to(torch.float64)[None, :]  # (max_len, d/2)
        self.cos_cached = angles.cos().to(torch.float32)
        self.sin_cached = angles.sin().to(torch.float32)

    @property
    def cache_length(self) -> int:
        return self.cos_cached.shape[0]

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (T, rotary_dim/2) cos and sin at integer ``positions`` (T,); grows the cache."""
        if positions.numel():
            needed = int(positions.max()) + 1
            stale = self.cos_cached.device != positions.device or self.cos_cached.dtype != torch.float32
            if needed > self.cache_length or stale:
                # Explicit growth: at least double, so decoding does not rebuild at every step.
                self.inv_freq = self.inv_freq.to(positions.device)
                self.build_cache(max(needed, 2 * self.cache_length) if needed > self.cache_length else self.cache_length)
        return self.cos_cached[positions], self.sin_cached[positions]

    def rotate_one(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x (B, H, T, D) at ``positions`` (T,)."""
        cos, sin = self.cos_sin(positions)  # (T, r/2) float32
        r = self.rotary_dim
        xr = x[..., :r].to(torch.float32)
        if self.layout == "half":
            x1, x2 = xr[..., : r // 2], xr[..., r // 2 :]
            rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
            rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        rotated = rotated.to(x.dtype)
        if r == x.shape[-1]:
            return rotated
        return torch.cat((rotated, x[..., r:]), dim=-1)

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotate_one(q, q_positions), self.rotate_one(k, k_positions)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, base={self.base}, layout={self.layout!r}, rotary_dim={self.rotary_dim}"
