"""posenc: positional encodings for Transformer attention, behind one protocol.

    import posenc
    enc = posenc.build("alibi", num_heads=8, head_dim=64)
    attn = posenc.Attention(512, 8, enc)

See ``posenc.available()`` for the methods and ``docs/`` in the repository for the design,
the protocol and the conventions.
"""

from __future__ import annotations

from .call.geometry import Geometry
from .encodings import PositionalEncoding, alibi_slopes, available, build, relative_position_bucket
from .encodings.axial_rope import patch_positions
from .encodings.mrope import continue_positions, vision_text_positions
from .errors import UsageError
from .functional import attend
from .hf.rope_config import mrope_from_hf, rope_from_hf
from .hf.schedule_config import schedule_from_hf
from .model.attention import Attention
from .model.checkpoint import load_checkpoint, save_checkpoint
from .model.lm import LM, LMConfig
from .model.schedule import Layer, Schedule
from .version import __version__

__all__ = [
    "attend",
    "Geometry",
    "Attention",
    "LM",
    "LMConfig",
    "Layer",
    "Schedule",
    "PositionalEncoding",
    "UsageError",
    "alibi_slopes",
    "available",
    "build",
    "continue_positions",
    "load_checkpoint",
    "mrope_from_hf",
    "patch_positions",
    "relative_position_bucket",
    "rope_from_hf",
    "save_checkpoint",
    "schedule_from_hf",
    "vision_text_positions",
    "__version__",
]
