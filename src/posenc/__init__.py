"""posenc: positional encodings for Transformer attention, behind one protocol.

    import posenc
    enc = posenc.build("alibi", num_heads=8, head_dim=64)
    attn = posenc.Attention(512, 8, enc)

See ``posenc.available()`` for the methods and ``../shared/DESIGN.md`` for the conventions.
"""

from __future__ import annotations

from .attention import Attention
from .encodings import PositionalEncoding, alibi_slopes, available, build, relative_position_bucket
from .model import LM, LMConfig

__version__ = "0.1.0"

__all__ = [
    "Attention",
    "LM",
    "LMConfig",
    "PositionalEncoding",
    "alibi_slopes",
    "available",
    "build",
    "relative_position_bucket",
    "__version__",
]
