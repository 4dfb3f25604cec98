"""The models a study trains and scores, as one type for annotations.

posenc's own :class:`~posenc.model.lm.LM`, or, in a study with ``hf_config``, a ``transformers`` model
inside :class:`posenc.study.hf_models.StudyModel`. Both are modules called as ``model(tokens)`` -> logits,
with ``config`` (``num_heads``, ``to_dict()``), ``max_length`` and ``drop_positions()``. The second
is named for the type checker only: importing the study never imports ``transformers``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

from ..model.lm import LM

if TYPE_CHECKING:
    from .hf_models import StudyModel

StudiedModel = Union[LM, "StudyModel"]

__all__ = ["StudiedModel"]
