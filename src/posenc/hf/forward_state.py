"""What the attention layers of one model forward share (:class:`ForwardState`), and the module that
starts each forward in place of the model's rotary module (:class:`RotaryStandIn`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..call.geometry import Geometry
from ..call.memo import ForwardMemo, Workspace


class ForwardState:
    """What the layers of one model forward share: geometries (one per key length and mask), their
    memo, the model-level position_ids, and the decode steps' workspace."""

    def __init__(self) -> None:
        self.base: nn.Module | None = None  # the decoder stack (its gradient_checkpointing flag)
        self.entries: list[tuple[Any, ...]] = []
        self.memo: ForwardMemo = ForwardMemo()
        self.position_ids: torch.Tensor | None = None
        # The positions the model hands its rotary module: made by the model (past cache length +
        # arange) when it was given none. Layers passed no position_ids (Llama 4) of a forward given
        # none and no padding mask take these: counted from the keys a cached call holds instead,
        # they were wrong once a sliding or chunked layer's cache had dropped its first keys.
        self.made_position_ids: torch.Tensor | None = None
        # The single-query paths' buffers between decode steps (a relative bias vector, a padding
        # mask), kept across forwards as posenc's own KV cache keeps them: every entry is rebuilt
        # when what made it (sizes, padding, the encoding's parameter versions) changes.
        self.workspace = Workspace()

    def start(self) -> None:
        self.entries = []
        self.made_position_ids = None
        self.memo = ForwardMemo(self.workspace)

    def finish(self) -> None:
        """The model forward returned: its memo (T5's bias table, built from parameters: part of
        the graph) and geometries are dropped, so nothing of that forward stays on the model
        (``copy.deepcopy`` after a forward with gradients). The position_ids stay (an input, no
        graph): a checkpointed layer recomputed in backward reads them again."""
        self.entries = []
        self.memo = ForwardMemo(self.workspace)

    def find(self, tq: int, tk: int, mask: torch.Tensor | None, pos: torch.Tensor | None) -> tuple[Any, ...] | None:
        for entry in self.entries:
            if entry[0] == tq and entry[1] == tk and entry[2] is mask and entry[3] is pos:
                return entry
        return None

    def add(self, tq: int, tk: int, mask: torch.Tensor | None, pos: torch.Tensor | None, key_end: int,
            geometry: Geometry) -> tuple[Any, ...]:
        entry = (tq, tk, mask, pos, key_end, geometry)
        self.entries.append(entry)
        return entry


class RotaryStandIn(nn.Module):
    """Stands in for a model's rotary module, holding it (``original``, a submodule, so it follows
    ``.to()``; its tables are not persistent buffers, so checkpoints do not change). Each call
    starts a new forward for the attention layers, calls the original and returns its output's
    types and shapes as the identity rotation (cos = 1, sin = 0; a complex table of ones), so the
    model's own rotation leaves q and k exactly as they are, whatever its layout, slice or dtype.
    ``sin_first``: the original returns ``(sin, cos)`` (GPT-J, CodeGen: ``Family.sincos_table``), so
    the identity is (zeros, ones). ``starts``: False for a rotary module each attention layer calls
    (``Family.attention_rotary``: RecurrentGemma, Moshi), where a call is not a new forward (the
    decoder stack's pre-hook starts it).
    """

    def __init__(self, original: nn.Module, sin_first: bool = False, starts: bool = True) -> None:
        super().__init__()
        self.original = original
        self.forward_state = ForwardState()
        self.identity = True  # False: the original's own tables pass through (the model rotates)
        self.sin_first = sin_first
        self.starts = starts

    def __getattr__(self, name: str) -> Any:
        """What the model reads from its rotary module besides calling it (Ergo's ``rope_type``: the
        layer types it calls it for) is the original's."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "original" or "original" not in self.__dict__.get("_modules", {}):
                raise
            return getattr(self._modules["original"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state = self.forward_state
        if self.starts:
            state.start()
        made = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        if isinstance(made, torch.Tensor) and made.dim() == 2 and not made.is_floating_point():
            state.made_position_ids = made  # what the model rotates at (see ForwardState)
        out = self.original(*args, **kwargs)
        if not self.identity:
            return out
        if isinstance(out, tuple):
            if self.sin_first:
                return (torch.zeros_like(out[0]), torch.ones_like(out[1]), *out[2:])
            return (torch.ones_like(out[0]), torch.zeros_like(out[1]), *out[2:])
        return torch.ones_like(out)


__all__ = ["ForwardState", "RotaryStandIn"]
