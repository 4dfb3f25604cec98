"""xPos: RoPE with a decay on the score (Sun et al. 2022, "A Length-Extrapolatable Transformer", §3.2).

The query at position n is rotated as in RoPE and multiplied by ``zeta_k^(n / scale_base)``, the key
by ``zeta_k^(-n / scale_base)`` (one factor per pair k of rotated features), with
``zeta_k = (2k/d + 0.4) / 1.4``, between 0.29 (the fastest pair) and 1. Every score term of pair k
then carries ``zeta_k^((i - j) / scale_base)``: the fast, oscillating pairs fade with the distance
and the slow ones barely do, which steadies attention past the training length. For a key after
the query the factor would grow instead, so xPos is a causal method only. The rotation is RoPE's
own (:func:`~posenc.encodings.rope.apply_rotation`), in the paper's interleaved layout by default.

Centring (``centre=True``, the paper and its authors' code ``torchscale``): the exponents use
``n - c`` with ``c = ceil(l / 2)``, ``l`` the current length (largest position + 1), for queries and
keys alike; c cancels in every score, but it keeps the factors within ``zeta^(+-l / 2 / scale_base)``.
Because c follows the length, ``rotation_depends_on_length`` is then True. ``centre=False``: c = 0,
keys cached rotated, the factors reach ``zeta^(-l / scale_base)``.

Decoding with the centre (:meth:`XPos.rotate_in_frame`, which the attention calls instead of
``rotate`` when a KV cache is given). The centre is a constant shift of both exponents, so any one
centre gives the same scores as long as the query and every key use it: a cache keeps its keys
rotated and scaled with the centre they were given (its *frame*, one per layer cache), and a new
query gets that centre too. A step then rotates only the new tokens, O(T x D), instead of every
cached key. The whole cache is re-centred (each cached key multiplied by one factor per pair,
``zeta_k^((c' - c) / scale_base)``) only when the newest position passes twice the centre: the new
centre is then the current length (or, near the dtype's limit, the largest centre position 0 allows),
so re-centring happens when the length doubles, amortised O(1) per step, and the factors stay within
twice the exponent the full pass uses at that length (e^10 at 4096 positions with scale_base 512).
The first call of a cache (the prefill) takes the full pass's centre ``ceil(l / 2)``. The scores
equal the full pass's to float32 rounding (``tests/encodings/test_xpos.py`` checks long caches). Either way the largest factor must fit the dtype:
past ``sqrt(finfo.max)`` of the input dtype (float32 / bfloat16: |n - c| above ~18000 with scale_base 512;
float16: ~2300) the call is a UsageError rather than a silent overflow.

Blockwise causal attention (``block_size``, the paper's §3.3, used at evaluation with blocks of half
the training length): the sequence is cut into blocks of ``block_size`` positions and a query
attends, causally, to its own block and the previous one only (so to between 1 and
2 * block_size - 1 keys; never further than the training length). It changes the attention, not
q and k: it is offered as an additive score bias, 0 inside the window and -inf outside, through the
usual ``bias`` / ``score`` hooks, present only when ``block_size`` is set.

Shape legend: B batch, H heads, T / Tq / Tk lengths, D head dim (= d).
"""

from __future__ import annotations

import math
import weakref
from typing import Callable

import torch

from ..errors import UsageError, check_positive
from .base import PositionalEncoding, bias_from_score
from .rope import LAYOUTS, RoPE, apply_rotation, check_rotation_inputs


class XPos(PositionalEncoding):
    """RoPE plus xPos's per-pair decay; optional blockwise causal attention.

    Args:
        base: RoPE's theta base (10000 in the paper).
        scale_base: the decay's length scale (512 in the paper).
        layout: "interleaved" (the paper, torchscale) or "half".
        centre: centre the decay exponents on the current length (see the module docstring).
        block_size: None, or the block of blockwise causal attention (half the training length).
        cache_length: initial rows of the cos/sin tables.
    """

    name = "xpos"
    description = "RoPE with a per-frequency decay of q.k with distance (Sun et al. 2022); causal only"
    extrapolates = True
    causal_only = True
    shift_invariant = True  # scores depend on i - j only (one shared centre moves q and k alike)

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        causal: bool = True,
        base: float = 10000.0,
        scale_base: float = 512.0,
        layout: str = "interleaved",
        centre: bool = True,
        block_size: int | None = None,
        cache_length: int = 2048,
    ) -> None:
        super().__init__(num_heads, head_dim, causal)
        if layout not in LAYOUTS:
            raise UsageError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if isinstance(scale_base, bool) or not isinstance(scale_base, (int, float)) or not 0 < scale_base < math.inf:
            raise UsageError(f"scale_base must be a number > 0, got {scale_base!r}")
        if not isinstance(centre, bool):
            raise UsageError(f"centre must be true or false, got {centre!r}")
        self.rotary = RoPE(num_heads, head_dim, causal, base=base, layout=layout, cache_length=cache_length)
        self.scale_base = float(scale_base)
        self.centre = centre
        self.block_size = None if block_size is None else check_positive("block_size", block_size)
        pairs = torch.arange(0, head_dim, 2, dtype=torch.float64)
        self.log_zeta = torch.log((pairs / head_dim + 0.4) / 1.4)  # (d/2,) float64, all < 0

    @property
    def rotation_depends_on_length(self) -> bool:
        return self.centre

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        state.pop("_frames", None)  # weak references to live caches: a copy starts without frames
        return state

    def _pair_scale(self, delta: float, device: torch.device) -> torch.Tensor:
        """float32 (D,): each feature times zeta_k^(delta / scale_base) of its pair k (in the layout)."""
        f = torch.exp(self.log_zeta.to(device) * (delta / self.scale_base)).to(torch.float32)  # (d/2,)
        return torch.cat((f, f)) if self.rotary.layout == "half" else f.repeat_interleave(2)

    def _farthest_centre(self, dtype: torch.dtype) -> int:
        """The largest centre that keeps position 0's factor within what ``dtype`` holds."""
        limit = 0.5 * math.log(min(torch.finfo(dtype).max, torch.finfo(torch.float32).max))
        return int(limit * self.scale_base / -float(self.log_zeta[0]))

    def rotate_in_frame(
        self, q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor, cache: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``rotate`` for a KV cache, amortised O(1) in its length (see the module docstring).

        ``k`` (B, H, past + T, D) is every key of the layer ``cache`` just returned from its append:
        rows already in ``cache``'s frame (rotated with its centre by an earlier call) and the new,
        un-rotated ones. Without autograd the new rows are rotated in place (written into the cache,
        which then keeps them rotated) and a re-centre rescales the cached rows in place; under
        autograd nothing is written and the same keys come back as a new tensor.
        """
        if not self.centre:
            return self.rotate(q, k, q_positions, k_positions)
        lo, length = check_rotation_inputs(self, q, k, q_positions, k_positions)
        if not length:
            return q, k
        frames = self.__dict__.setdefault("_frames", weakref.WeakKeyDictionary())
        frame = frames.get(cache)
        past = length - q.shape[-2]
        framed = 0 if frame is None else min(frame[1], past)  # crop / reset: rows past the cache's length are gone
        centre = frame[0] if framed else (length + 1) // 2  # the first call: the full pass's centre
        target = centre
        if length - 1 > 2 * centre:  # the newest key passed twice the centre: re-centre (the length doubled)
            target = min(length - 1, self._farthest_centre(q.dtype))
        self._check_range(lo, length - 1, target, q.dtype)
        rope = self.rotary
        q_cos, q_sin = rope.cos_sin(q_positions, length)  # (Tq, d/2) float32
        q = apply_rotation(q, q_cos, q_sin, rope.layout, self.decay(q_positions, target, 1.0))
        new_positions = k_positions[framed:]
        k_cos, k_sin = rope.cos_sin(new_positions, length)
        new = apply_rotation(k[:, :, framed:], k_cos, k_sin, rope.layout, self.decay(new_positions, target, -1.0))
        old = k[:, :, :framed]
        write = not (torch.is_grad_enabled() and k.requires_grad)
        if write:
            with torch.no_grad():
                if framed and target != centre:
                    old.mul_(self._pair_scale(target - centre, k.device).to(k.dtype))
                k[:, :, framed:] = new
            frames[cache] = (target, length)
            return q, k
        if framed and target != centre:
            old = (old.to(torch.float32) * self._pair_scale(target - centre, k.device)).to(k.dtype)
        return q, torch.cat((old, new), dim=-2)

    def decay(self, positions: torch.Tensor, centre: int, sign: float) -> torch.Tensor:
        """float32 (T, d/2): zeta_k^(sign * (n - centre) / scale_base) at positions n."""
        log_zeta = self.log_zeta.to(positions.device)
        exponent = (positions.to(torch.float64) - centre)[:, None] * (sign / self.scale_base)  # (T, 1)
        return torch.exp(exponent * log_zeta[None, :]).to(torch.float32)

    def _check_range(self, lo: int, hi: int, centre: int, dtype: torch.dtype) -> None:
        far = max(abs(lo - centre), abs(hi - centre))
        largest = -far / self.scale_base * float(self.log_zeta[0])  # ln of the largest factor
        limit = 0.5 * math.log(min(torch.finfo(dtype).max, torch.finfo(torch.float32).max))
        if largest > limit:
            raise UsageError(
                f"xpos: positions {lo}..{hi} (centre {centre}) with scale_base={self.scale_base:g} need decay "
                f"factors up to e^{largest:.0f}, beyond what {str(dtype).removeprefix('torch.')} holds; "
                + self._advice(lo, hi, far, limit, dtype)
            )

    def _advice(self, lo: int, hi: int, far: int, limit: float, dtype: torch.dtype) -> str:
        """What would make positions lo..hi fit: only settings not already in effect, and the
        smallest scale_base that fits as things are."""
        zeta = -float(self.log_zeta[0])
        ways = [f"scale_base >= {math.ceil(far * zeta / limit):d}"]
        centre = (hi + 2) // 2  # centred on the length hi + 1, as rotate centres
        if not self.centre and max(abs(lo - centre), abs(hi - centre)) * zeta / self.scale_base <= limit:
            ways.append("centre=True")
        wide = 0.5 * math.log(torch.finfo(torch.float32).max)
        if limit < wide and far * zeta / self.scale_base <= wide:
            ways.append("float32 inputs")
        if len(ways) == 1:
            return f"use {ways[0]} (centre={self.centre} and float32's range are already in effect)" if self.centre \
                else f"use {ways[0]}"
        return "use " + ", or ".join(ways)

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lo, length = check_rotation_inputs(self, q, k, q_positions, k_positions)
        if not length:
            return q, k
        centre = (length + 1) // 2 if self.centre else 0  # ceil(l / 2), as the authors' code
        self._check_range(lo, length - 1, centre, q.dtype)
        rope = self.rotary
        q_cos, q_sin = rope.cos_sin(q_positions, length)  # (Tq, d/2) float32
        k_cos, k_sin = rope.cos_sin(k_positions, length)  # (Tk, d/2)
        q = apply_rotation(q, q_cos, q_sin, rope.layout, self.decay(q_positions, centre, 1.0))
        k = apply_rotation(k, k_cos, k_sin, rope.layout, self.decay(k_positions, centre, -1.0))
        return q, k

    # -- blockwise causal attention: bias/score hooks, present only with a block_size -------------

    @property
    def score(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
        return self._block_score if self.block_size else None

    @property
    def bias(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        return self._block_bias if self.block_size else None

    def _block_score(self, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """0 where key j is in query i's block or the previous one, -inf elsewhere (elementwise)."""
        size = self.block_size or 1  # set: this hook exists only with a block_size
        inside = (torch.div(j, size, rounding_mode="floor") >= torch.div(i, size, rounding_mode="floor") - 1) & (h >= 0)
        return torch.where(inside, 0.0, float("-inf"))

    def _block_bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        return bias_from_score(self, q_positions, k_positions)  # (H, Tq, Tk)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, base={self.rotary.base}, scale_base={self.scale_base:g}, layout={self.rotary.layout!r}, "
            f"centre={self.centre}, block_size={self.block_size}"
        )
