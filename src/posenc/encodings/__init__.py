"""Registry of positional encodings: one file per method, one line per method here."""

from __future__ import annotations

import inspect
from typing import Any

from ..errors import UsageError, check_positive
from .alibi import ALiBi, alibi_slopes
from .axial_rope import AxialRoPE, RoPEMixed
from .base import PositionalEncoding, has_hook
from .cope import CoPE
from .deberta import DeBERTa
from .dynamic_bias import DynamicPositionBias
from .fire import FIRE
from .fope import FoPE
from .fox import ForgettingTransformer
from .inkling import Inkling
from .kerple import KERPLE
from .learned import Learned
from .mrope import MRoPE
from .nope import NoPE
from .partial_heads import OPTIONS as COMMON_OPTIONS
from .partial_heads import PartialHeads, check_heads
from .pope import PoPE
from .protocol import offers
from .remap import STRING, DualChunk, ReRoPE, SelfExtend
from .rope import RoPE
from .sandwich import Sandwich
from .selective import SelectiveAttention
from .shaw import Shaw
from .sinusoidal import Sinusoidal
from .t5 import T5Bias, relative_position_bucket
from .transformer_xl import TransformerXL
from .xdrope import XDRoPE
from .xpos import XPos

REGISTRY: dict[str, type[PositionalEncoding]] = {
    cls.name: cls
    for cls in (NoPE, Sinusoidal, Learned, Shaw, TransformerXL, T5Bias, RoPE, ALiBi, KERPLE, Sandwich, FIRE, CoPE)
}
REGISTRY[XPos.name] = XPos
REGISTRY[MRoPE.name] = MRoPE  # multi-axis RoPE: positions with an axis dimension (or 1-D, as RoPE)
REGISTRY[AxialRoPE.name] = AxialRoPE
REGISTRY[RoPEMixed.name] = RoPEMixed
REGISTRY[XDRoPE.name] = XDRoPE  # Hunyuan-VL's four-axis RoPE: (4, T) or (4, B, T) ids
REGISTRY[FoPE.name] = FoPE  # RoPE's pairs as learned Fourier series (per key head)
REGISTRY[DeBERTa.name] = DeBERTa
REGISTRY[ForgettingTransformer.name] = ForgettingTransformer
REGISTRY[Inkling.name] = Inkling  # data-dependent distance curves per query (the Curves hook)
REGISTRY[SelectiveAttention.name] = SelectiveAttention  # one head's selection masks keys from later queries (the Selects hook)
REGISTRY[PoPE.name] = PoPE  # its rotate widens q and k to 2 D features (values keep D)
REGISTRY[DynamicPositionBias.name] = DynamicPositionBias
for _remap in (SelfExtend, ReRoPE, STRING, DualChunk):  # training-free position remaps of RoPE (remap.py)
    REGISTRY[_remap.name] = _remap


def available() -> list[str]:
    """Registry names of every encoding: the classic line up to ALiBi, then the methods after it."""
    return list(REGISTRY)


def get_class(name: str) -> type[PositionalEncoding]:
    """The encoding class registered as ``name``.

    Raises:
        UsageError: no encoding is registered as ``name`` (listing the choices).
    """
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise UsageError(f"unknown encoding {name!r}; available: {', '.join(available())}") from None


def options_of(cls: type[PositionalEncoding]) -> list[str]:
    """The method's keyword options: its constructor's parameters beyond the sizes and ``causal``,
    then the options every method takes (:data:`COMMON_OPTIONS`: ``position_heads``,
    ``position_heads_at``, handled by :func:`build`)."""
    own = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "num_heads", "head_dim", "causal")]
    return own + [p for p in COMMON_OPTIONS if p not in own]


def build(name: str, *, num_heads: int, head_dim: int, causal: bool = True, **options: Any) -> PositionalEncoding:
    """Build the encoding ``name`` for ``num_heads`` heads of ``head_dim`` features.

    ``options`` are the method's own keyword arguments (e.g. ``layout="interleaved"`` for rope,
    ``num_buckets=32`` for t5), and the options of every method: ``position_heads`` P (an integer in
    1 .. num_heads) builds the method for P heads and puts it on the first P heads, or the last
    with ``position_heads_at="last"``, the others NoPE (:mod:`.partial_heads`).

    Raises:
        UsageError: an unknown name (listing the choices), an unknown option (naming the accepted
            ones), or a size or option the method's constructor rejects (naming it and its range;
            :class:`~posenc.encodings.base.PositionalEncoding` checks the sizes for every method);
            ``position_heads`` outside 1 .. num_heads, or a method whose hooks cannot act on some heads.
    """
    cls = get_class(name)
    accepted = options_of(cls)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        own = [p for p in accepted if p not in COMMON_OPTIONS]
        raise UsageError(
            f"encoding {name!r} got unknown option(s) {unknown}; accepted: {own or 'none'} "
            f"(and {', '.join(COMMON_OPTIONS)}, which every method takes)"
        )
    count, at = options.pop("position_heads", None), options.pop("position_heads_at", None)
    if count is None:
        if at is not None:
            raise UsageError("position_heads_at needs position_heads (the number of heads with positions)")
        return cls(num_heads, head_dim, causal, **options)
    check_positive("num_heads", num_heads)
    count, at = check_heads(count, num_heads, "first" if at is None else at)
    if "input_dim" in options_of(cls) and "input_dim" not in options:
        options["input_dim"] = num_heads * head_dim  # (a gate reads the layer's input, all heads wide)
    return PartialHeads(cls(count, head_dim, causal, **options), num_heads, at)


__all__ = [
    "COMMON_OPTIONS",
    "REGISTRY",
    "PositionalEncoding",
    "available",
    "build",
    "get_class",
    "has_hook",
    "offers",
    "options_of",
    "alibi_slopes",
    "relative_position_bucket",
]
