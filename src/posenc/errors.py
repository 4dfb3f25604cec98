"""Errors posenc raises on purpose.

:class:`UsageError` is a user's mistake (a bad option, a missing file, a length past a table): the
command line prints it as one line, without a traceback. Its message names the parameter and the
allowed range, in the library's words (``train_length``), not a flag's (``--train-length``), so it
reads the same from Python and from the shell. Anything else that escapes is a bug, or a fault of
the machine, and keeps its traceback.

It subclasses ``ValueError``, so ``except ValueError`` in user code still catches it.
"""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


class UsageError(ValueError):
    """A user error: bad input or option, reported in one line naming the parameter."""


def check_positive(name: str, value: int) -> int:
    """``value`` if it is a positive integer, else a UsageError naming the parameter.

    Raises:
        UsageError: ``value`` is not an int >= 1 (a bool is not), naming ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{name} must be a positive integer (>= 1), got {value!r}")
    return value


def check_window_chunk(window: object, chunk: object, where: str = "") -> None:
    """A layer's local attention: ``window`` and ``chunk`` each None or a positive integer, not both.

    Raises:
        UsageError: ``window`` or ``chunk`` is not None or an int >= 1 (a bool is not), naming it.
        UsageError: both are given.
    """
    for name, value in (("window", window), ("chunk", chunk)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UsageError(f"{where}{name} must be a positive integer (>= 1) or None, got {value!r}")
    if window is not None and chunk is not None:
        raise UsageError(f"{where}give window or chunk, not both (got window={window}, chunk={chunk})")


def check_int(name: str, value: object, low: int, high: int, why: str = "") -> int:
    """``value`` if it is an integer in [low, high], else a UsageError naming ``name`` and the range.

    Raises:
        UsageError: ``value`` is not an int in [low, high] (a bool is not), naming ``name`` and the range.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UsageError(f"{name} must be an integer in [{low}, {high}]{why}, got {value!r}")
    return value


def as_kind(value: object, kind: type[T]) -> T:
    """``value`` as the ``kind`` its maker promised (a study's ``Models`` given back its own model).

    Raises:
        TypeError: ``value`` is not a ``kind``: a programming error, not a user's.
    """
    if not isinstance(value, kind):
        raise TypeError(f"expected a {kind.__name__}, got {type(value).__name__}")
    return value


__all__ = ["UsageError", "as_kind", "check_int", "check_positive"]
