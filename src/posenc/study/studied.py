"""The models a study trains and scores, as one type for annotations.

posenc's own :class:`~posenc.model.LM`, or, in a study with ``hf_config``, a ``transformers`` model
inside :class:`posenc.study.hf_models.StudyModel`. Both are modules called as ``model(tokens)`` -> logits,
with ``config`` (``num_heads``, ``to_dict()``), ``max_length`` and ``drop_positions()``. The second
is named for the type checker only: importing the study never imports ``transformers``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar, Union

from ..model import LM

if TYPE_CHECKING:
    from .hf_models import StudyModel

StudiedModel = Union[LM, "StudyModel"]

M = TypeVar("M")


def as_kind(model: StudiedModel, kind: type[M]) -> M:
    """``model`` as the ``kind`` of model that made it.

    Raises:
        TypeError: ``model`` is not a ``kind`` (a ``Models`` method given another kind's model: a
            programming error, not a user's).
    """
    if not isinstance(model, kind):
        raise TypeError(f"expected a {kind.__name__} (made by the study's own Models), got {type(model).__name__}")
    return model


__all__ = ["StudiedModel", "as_kind"]
