"""Model checkpoints: weights as safetensors, the :class:`~posenc.model.LMConfig` as json beside them.

Neither file can execute code when read (no pickle), so a checkpoint from anywhere is safe to load.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .files import atomic_write, write_json
from .model import LM, LMConfig
from .version import __version__


def save_checkpoint(model: LM, path: str | Path) -> None:
    """Weights as safetensors (shared tensors, e.g. T5's one table for all layers, stored once)
    next to ``path.with_suffix('.json')`` holding the :class:`LMConfig`."""
    from safetensors.torch import save_model

    path = Path(path)
    atomic_write(path, lambda p: save_model(model, str(p)))
    write_json(path.with_suffix(".json"), {"lm_config": model.config.to_dict(), "posenc": __version__})


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> LM:
    """An :class:`LM` from a checkpoint written by :func:`save_checkpoint` (e.g. a study's
    ``checkpoints/METHOD.safetensors``)."""
    from safetensors.torch import load_model

    path = Path(path)
    meta = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
    model = LM(LMConfig(**meta["lm_config"]))
    load_model(model, str(path), device=str(device))
    return model.to(device)
