"""Errors posenc raises on purpose.

:class:`UsageError` is a user's mistake (a bad option, a missing file, a length past a table): the
command line prints it as one line, without a traceback. Its message names the parameter and the
allowed range, in the library's words (``train_length``), not a flag's (``--train-length``), so it
reads the same from Python and from the shell. Anything else that escapes is a bug, or a fault of
the machine, and keeps its traceback.

It subclasses ``ValueError``, so ``except ValueError`` in user code still catches it.
"""

from __future__ import annotations


class UsageError(ValueError):
    """A user error: bad input or option, reported in one line naming the parameter."""


__all__ = ["UsageError"]
