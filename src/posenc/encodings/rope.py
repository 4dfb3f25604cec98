"""Rotary position embedding, RoPE (Su et al. 2021, "RoFormer", §3.4), and its long-context scalings.

Queries and keys are rotated, pair of features by pair of features, by the angle ``pos * theta_k``
with ``theta_k = base^(-2k/r)``; the dot product of a rotated query and key then depends on the
content and on ``i - j`` only. Two feature layouts are in use, the same function up to a
permutation of q/k features:

- ``layout="half"``: feature k pairs with feature k + r/2 (GPT-NeoX, Hugging Face LLaMA);
- ``layout="interleaved"``: feature 2k pairs with 2k + 1 (the RoFormer paper, GPT-J).

``rotary_dim`` < head_dim rotates only the first ``rotary_dim`` features (partial rotary, GPT-J and
GPT-NeoX), spreading the whole frequency range over them. ``scaling`` takes the ``rope_scaling`` /
``rope_parameters`` block of a Hugging Face config (linear, ntk, dynamic, yarn, llama3, longrope,
proportional, ntk_alpha, resonance): see :mod:`.rope_scaling` for the schedules, and note that p-RoPE (``proportional``)
is not partial rotary. :func:`posenc.hf.rope_config.rope_from_hf` builds the encoding from a whole config.

Precision: the cos/sin tables are built in float32 from float64 angles of integer positions
whatever the input dtype, so every position up to 2^24 gets its own exact angle even for bfloat16
inputs; the rotation itself is computed in float32 and cast back once.

Length-dependent scalings (``dynamic``, ``longrope``) rotate every q and k of a call with the
parameters of the current length ``l = largest position + 1`` (Hugging Face's ``seq_len`` in a full
pass), and say so with ``rotation_depends_on_length``: the attention then keeps such keys
un-rotated in its KV cache and rotates all of them at every step, so the keys are never left
rotated with an older base (HF issues #25104, #33129). The cost is a rotation of all T cached keys
per step and layer (O(T x D), like one more row of attention scores), and, for ``dynamic`` past the
original length, new cos/sin tables of T rows per step (shared by the layers).

Shape legend: B batch, H heads, T length, D head dim, r rotated features (``rotary_dim``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UsageError, check_positive
from .base import PositionalEncoding
from .rope_frequencies import inverse_frequencies
from .rope_scaling import (
    MAX_BASE,
    RopeScaling,
    check_table,
    parse_scaling,
    rotary_dim_of,
)

LAYOUTS = ("half", "interleaved")


def apply_rotation(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str, scale: float | torch.Tensor | None = None
) -> torch.Tensor:
    """Rotate the first r = 2 * cos.shape[-1] features of ``x`` (B, H, T, D) pair by pair.

    ``cos``, ``sin``: float32 (T, r/2). ``scale``: None, a float, or float32 (T, r/2), multiplied
    into both features of each pair after the rotation (an attention factor, xPos's decay). Computed
    in float32, cast back to x's dtype once; features past r pass through.
    """
    r = 2 * cos.shape[-1]
    xr = x[..., :r].to(torch.float32)
    if layout == "half":
        x1, x2 = xr[..., : r // 2], xr[..., r // 2 :]
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin  # (B, H, T, r/2) each
    if scale is not None:
        y1, y2 = y1 * scale, y2 * scale
    rotated = torch.cat((y1, y2), dim=-1) if layout == "half" else torch.stack((y1, y2), dim=-1).flatten(-2)
    rotated = rotated.to(x.dtype)
    return rotated if r == x.shape[-1] else torch.cat((rotated, x[..., r:]), dim=-1)


def position_range(name: str, *positions: torch.Tensor) -> tuple[int, int]:
    """(smallest position, current length = largest position + 1) over ``positions``, one device
    sync; (0, 0) for none. Negative positions are a UsageError (indexing a table with them would
    silently wrap to its end)."""
    present = [p for p in positions if p.numel()]
    if not present:
        return 0, 0
    bounds = torch.stack([torch.stack(torch.aminmax(p)) for p in present]).tolist()  # [[min, max], ...]
    lo, hi = min(b[0] for b in bounds), max(b[1] for b in bounds)
    if lo < 0:
        raise UsageError(f"{name}: positions must be >= 0, got {lo}")
    return lo, hi + 1


def check_rotation_inputs(
    encoding: PositionalEncoding, q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor
) -> tuple[int, int]:
    """Check q/k head dims and positions against ``encoding``; return (smallest position, current
    length), the length being the largest position + 1 (the largest key position in attention)."""
    for label, x, pos in (("q", q, q_positions), ("k", k, k_positions)):
        if x.shape[-1] != encoding.head_dim:
            raise UsageError(
                f"{encoding.name}: {label} has {x.shape[-1]} features per head, but the encoding was built "
                f"for head_dim={encoding.head_dim}"
            )
        if pos.dim() != 1 or pos.numel() != x.shape[-2]:
            raise UsageError(f"{encoding.name}: {label}_positions must be 1-D with {x.shape[-2]} entries, got shape {tuple(pos.shape)}")
    return position_range(encoding.name, q_positions, k_positions)


#: The most a cos/sin table may take (its float32 rows plus the float64 angles they are built
#: from). Positions past the rows this allows are computed at the call (see RotaryTable.lookup).
MAX_TABLE_BYTES = 256 * 2**20


def table_rows(frequencies: int) -> int:
    """The most rows a :class:`RotaryTable` of ``frequencies`` columns holds (MAX_TABLE_BYTES)."""
    return max(1, MAX_TABLE_BYTES // (24 * max(frequencies, 1)))  # float64 angles, cos, sin + float32 cos, sin


class RotaryTable:
    """float32 cos/sin of one set of frequencies for positions 0 .. length-1, grown on demand up to
    :func:`table_rows` rows; rows for larger positions are computed when asked for, with the same
    float64 angles the table holds (a call at position 1e9 costs its own rows, not a table of 1e9).

    Not buffers on purpose: ``module.to(bfloat16)`` would cast them, and the tables must stay
    float32; a table follows the device of the positions it is asked for instead.

    Raises:
        UsageError: ``length`` (``cache_length``) past :func:`table_rows`.
    """

    def __init__(self, inv_freq: torch.Tensor, length: int, device: torch.device | None = None) -> None:
        self.inv_freq = inv_freq.to(torch.float32)  # (r/2,)
        self.build(length, device or inv_freq.device)

    def build(self, length: int, device: torch.device) -> None:
        most = table_rows(self.inv_freq.numel())
        if length > most:
            raise UsageError(f"cache_length: a cos/sin table of {self.inv_freq.numel()} frequencies holds at most {most:,} "
                             f"positions ({MAX_TABLE_BYTES // 2**20} MiB), got {length:,}; larger positions are "
                             "computed when they come, without a table")
        self.inv_freq = self.inv_freq.to(device)
        self.cos, self.sin = self._rows(torch.arange(length, device=device))

    def _rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin (*positions.shape, r/2) of float64 angles, rounded once: the best
        float32 can hold."""
        angles = positions.to(torch.float64).unsqueeze(-1) * self.inv_freq.to(positions.device, torch.float64)
        return angles.cos().to(torch.float32), angles.sin().to(torch.float32)

    @property
    def length(self) -> int:
        return self.cos.shape[0]

    def lookup(self, positions: torch.Tensor, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, r/2) cos and sin at ``positions`` (all < ``needed``); grows at least twofold, up to
        :func:`table_rows`; past it, the rows at ``positions`` are computed for this call."""
        if needed > self.length:
            most = table_rows(self.inv_freq.numel())
            if needed > most:
                return self._rows(positions)
            self.build(min(max(needed, 2 * self.length), most), positions.device)
        elif self.cos.device != positions.device:
            self.build(self.length, positions.device)
        return self.cos[positions], self.sin[positions]


class RoPE(PositionalEncoding):
    """Rotary embedding of q and k with explicit, growable float32 cos/sin tables.

    Args:
        base: theta base (default 10000, or the block's ``rope_theta``).
        layout: "half" or "interleaved" (see the module docstring).
        rotary_dim: rotated features (even, <= head_dim); the rest pass through. Also settable
            through ``partial_rotary_factor`` in ``scaling`` (not for ``proportional``).
        scaling: a Hugging Face ``rope_scaling`` / ``rope_parameters`` dict (or a
            :class:`~posenc.encodings.rope_scaling.RopeScaling`); None: plain RoPE.
        cache_length: initial number of cached positions (the tables grow as needed).
    """

    name = "rope"
    description = "rotates q and k by position-dependent angles (Su et al. 2021, RoFormer); HF scalings"
    extrapolates = True  # runs at any length, degrading past the training length
    shift_invariant = True  # depends on i - j only (rotation_depends_on_length switches it off)
    hf_source: str | None = None  # which block of a Hugging Face config built it (rope_from_hf)

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        causal: bool = True,
        base: float | None = None,
        layout: str = "half",
        rotary_dim: int | None = None,
        scaling: dict[str, Any] | RopeScaling | None = None,
        cache_length: int = 2048,
    ) -> None:
        super().__init__(num_heads, head_dim, causal)
        if head_dim % 2:
            raise UsageError(f"rope needs an even head_dim, got {head_dim}")
        if layout not in LAYOUTS:
            raise UsageError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.layout = layout
        self.initial_cache_length = check_positive("cache_length", cache_length)
        self._configure(base, rotary_dim, scaling)

    DEFAULT_BASE = 10000.0

    @classmethod
    def geometry(cls, head_dim: int, base: float | None = None, rotary_dim: int | None = None,
                 scaling: dict[str, Any] | RopeScaling | None = None) -> tuple[float, int]:
        """(base, rotated features) of an encoding built with these options, from the options and
        the declared defaults alone (nothing is built): ``base``, else the block's ``rope_theta``,
        else :attr:`DEFAULT_BASE`; ``rotary_dim``, else ``head_dim * partial_rotary_factor``, else
        ``head_dim``.

        Raises:
            UsageError: when ``base`` and the block's ``rope_theta``, or ``rotary_dim`` and its
                ``partial_rotary_factor``, disagree, or the base is outside (1, MAX_BASE].
        """
        cfg = parse_scaling(scaling)
        if base is not None and cfg.rope_theta is not None and float(base) != cfg.rope_theta:
            raise UsageError(f"base={base} disagrees with the scaling block's rope_theta={cfg.rope_theta}; give one of them")
        base = cfg.rope_theta if base is None else base
        base = cls.DEFAULT_BASE if base is None else base
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not 1 < base <= MAX_BASE:
            raise UsageError(f"base must be a finite number in (1, {MAX_BASE:g}], got {base!r}")
        return float(base), rotary_dim_of(cfg, head_dim, rotary_dim)

    def _configure(self, base: float | None, rotary_dim: int | None, scaling: dict[str, Any] | RopeScaling | None) -> None:
        cfg = parse_scaling(scaling)
        base, rotary_dim = self.geometry(self.head_dim, base, rotary_dim, cfg)
        if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or not 2 <= rotary_dim <= self.head_dim or rotary_dim % 2:
            raise UsageError(f"rotary_dim must be an even integer in [2, head_dim={self.head_dim}], got {rotary_dim!r}")
        cfg.check_rotary_dim(rotary_dim)
        if cfg.rope_type == "proportional" and int((cfg.partial_rotary_factor or 1.0) * rotary_dim // 2) < 1:
            raise UsageError(f"proportional rope: partial_rotary_factor={cfg.partial_rotary_factor} keeps no frequency of {rotary_dim // 2}")
        if cfg.rope_type in ("ntk", "dynamic", "ntk_alpha") and rotary_dim < 4:
            raise UsageError(f"rope scaling: {cfg.rope_type} raises the base to the power r/(r-2) of the rotated "
                             f"features r: it needs rotary_dim >= 4, got {rotary_dim}")
        inv_freq, attention_factor = inverse_frequencies(cfg, base, rotary_dim)
        check_table(cfg, float(base), rotary_dim, inv_freq, attention_factor)
        self.scaling, self.base, self.rotary_dim = cfg, float(base), rotary_dim
        # Multiplies the rotated q and k (HF scales cos and sin): logits scale by its square.
        self.attention_factor = attention_factor
        self._main = RotaryTable(inv_freq, self.initial_cache_length)  # at lengths <= L (or any: static types)
        self._long: RotaryTable | None = None  # longrope past L
        self._at_length: tuple[int, RotaryTable] | None = None  # dynamic past L: the last length's table

    def set_scaling(self, scaling: dict[str, Any] | RopeScaling | None) -> None:
        """Swap the scaling in place, keeping base and rotary_dim: evaluate a trained RoPE model
        under another scaling without retraining (every layer sharing this encoding follows)."""
        self._configure(self.base, self.rotary_dim, scaling)

    @property
    def rotation_depends_on_length(self) -> bool:  # read by the attention (see the module docstring)
        return self.scaling.depends_on_length

    # -- tables ---------------------------------------------------------------------------------

    @property
    def inv_freq(self) -> torch.Tensor:
        """float32 (r/2,) frequencies at lengths up to the original one (all lengths: static types)."""
        return self._main.inv_freq

    @property
    def cos_cached(self) -> torch.Tensor:
        return self._main.cos

    @property
    def sin_cached(self) -> torch.Tensor:
        return self._main.sin

    @property
    def cache_length(self) -> int:
        return self._main.length

    def build_cache(self, max_len: int) -> None:
        """(Re)build the main float32 cos/sin tables for positions 0..max_len-1."""
        self._main.build(max_len, self._main.inv_freq.device)

    def frequencies(self, length: int | None = None) -> torch.Tensor:
        """float32 (r/2,) frequencies used at the current ``length`` (None: the original length)."""
        return inverse_frequencies(self.scaling, self.base, self.rotary_dim, length)[0].to(self._main.inv_freq.device)

    def _table(self, length: int, device: torch.device) -> RotaryTable:
        cfg = self.scaling
        if not cfg.depends_on_length or length <= (cfg.original_length or 0):
            return self._main
        if cfg.rope_type == "longrope":
            if self._long is None:
                theta, _ = inverse_frequencies(cfg, self.base, self.rotary_dim, length)
                self._long = RotaryTable(theta, self.initial_cache_length, device)
            return self._long
        # dynamic past L: a fresh base at every length. Memoised, so the layers of one step share it.
        if self._at_length is None or self._at_length[0] != length:
            theta, _ = inverse_frequencies(cfg, self.base, self.rotary_dim, length)
            self._at_length = (length, RotaryTable(theta, min(length, table_rows(theta.numel())), device))
        return self._at_length[1]

    def cos_sin(self, positions: torch.Tensor, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (T, r/2) cos and sin at integer ``positions`` (T,), with the parameters of the
        current ``length``; grows the tables as needed. Without ``length``: the largest position + 1,
        and positions are checked; with it, they must already lie in [0, length) (checked by rotate)."""
        if length is None:
            length = position_range(self.name, positions)[1]
        if not positions.numel():
            empty = torch.empty(0, self.rotary_dim // 2, device=positions.device)
            return empty, empty
        return self._table(length, positions.device).lookup(positions, length)

    # -- rotation -------------------------------------------------------------------------------

    def rotate_one(self, x: torch.Tensor, positions: torch.Tensor, length: int | None = None) -> torch.Tensor:
        """Rotate x (B, H, T, D) at ``positions`` (T,), with the parameters of ``length``."""
        if length is None:
            length = check_rotation_inputs(self, x, x, positions, positions)[1]
        cos, sin = self.cos_sin(positions, length)  # (T, r/2) float32
        return apply_rotation(x, cos, sin, self.layout, None if self.attention_factor == 1.0 else self.attention_factor)

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.compiler.is_compiling() and not self.scaling.depends_on_length:
            # Compiled: the positions are not read on the host (that would break the graph); they
            # index the precomputed table (``cache_length`` positions, litgpt-style), whose bounds the
            # compiled indexing checks. Build a longer one first with ``build_cache`` if needed.
            table = self._main
            if table.cos.device != q.device:
                table.build(table.length, q.device)
            factor = None if self.attention_factor == 1.0 else self.attention_factor
            return (apply_rotation(q, table.cos[q_positions], table.sin[q_positions], self.layout, factor),
                    apply_rotation(k, table.cos[k_positions], table.sin[k_positions], self.layout, factor))
        _, length = check_rotation_inputs(self, q, k, q_positions, k_positions)  # largest key position + 1
        return self.rotate_one(q, q_positions, length), self.rotate_one(k, k_positions, length)

    def extra_repr(self) -> str:
        scaling = "" if self.scaling.rope_type == "default" else f", scaling={self.scaling.rope_type!r}"
        return f"{super().extra_repr()}, base={self.base}, layout={self.layout!r}, rotary_dim={self.rotary_dim}{scaling}"


def with_scaling(encoding: RoPE, scaling: dict[str, Any] | RopeScaling | None) -> RoPE:
    """A copy of ``encoding`` (same heads, base, layout, rotary_dim) under another ``scaling``."""
    if not isinstance(encoding, RoPE):
        raise UsageError(f"with_scaling needs a rope encoding, got {type(encoding).__name__}")
    return RoPE(
        encoding.num_heads, encoding.head_dim, encoding.causal, base=encoding.base, layout=encoding.layout,
        rotary_dim=encoding.rotary_dim, scaling=scaling, cache_length=encoding.initial_cache_length,
    )
