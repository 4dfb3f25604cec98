"""The models a study trains and scores, as one type for annotations.

posenc's own :class:`~posenc.model.lm.LM`, or, in a study with ``hf_config``, a ``transformers`` model
inside :class:`posenc.study.hf_models.StudyModel`. Both are modules called as ``model(tokens)`` -> logits,
with ``config`` (``num_heads``, ``to_dict()``), ``max_length`` and ``drop_positions()``. The second
is named for the type checker only: importing the study never imports ``transformers``.

This small module is a wall, kept on purpose: the modules that name the type (models.py, train.py,
fairness.py, pipeline.py) import it from here, never from hf_models.py, which imports
``transformers`` and the study's own rows, variants and config; named there, the type would tie
those modules into an import circle and make ``transformers`` a dependency of every study.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

from ..model.lm import LM

if TYPE_CHECKING:
    from .hf_models import StudyModel

StudiedModel = Union[LM, "StudyModel"]

__all__ = ["StudiedModel"]
