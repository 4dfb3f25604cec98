"""posenc: positional encodings for Transformer attention, behind one protocol.

    import posenc
    enc = posenc.build("alibi", num_heads=8, head_dim=64)
    attn = posenc.Attention(512, 8, enc)

See ``posenc.available()`` for the methods and ``../shared/DESIGN.md`` for the conventions.
"""

from __future__ import annotations

from .attention import Attention
from .encodings import PositionalEncoding, alibi_slopes, available, build, relative_position_bucket
from .encodings.rope import rope_from_hf
from .errors import UsageError
from .model import LM, LMConfig
from .version import __version__



def load_checkpoint(path, device="cpu") -> LM:
    """Load a study checkpoint (``checkpoints/METHOD.safetensors`` + its ``.json`` config) into an LM."""
    from .study import load_checkpoint as _load

    return _load(path, device)


__all__ = [
    "Attention",
    "LM",
    "LMConfig",
    "PositionalEncoding",
    "UsageError",
    "alibi_slopes",
    "available",
    "build",
    "load_checkpoint",
    "relative_position_bucket",
    "rope_from_hf",
    "__version__",
]
