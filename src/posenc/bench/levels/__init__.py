"""The benchmark levels: one module each, one line here.

A new level is one module defining a :class:`~posenc.bench.levels.base.Level` named ``LEVEL``,
added to the tuple below. Decode timing, for example: a level whose ``build`` fills a KV cache of
``job.length`` tokens and returns a step that decodes one more token for ``job.batch`` sequences,
with ``tokens`` = the batch (so tokens/s is per generated token) and ``units`` in s/token; the
harness, rounds, ratios, tables and plots stay as they are.
"""

from __future__ import annotations

from . import attention, decode, model
from .base import Level, Refused, Workload

LEVELS: dict[str, Level] = {m.LEVEL.name: m.LEVEL for m in (attention, model, decode)}

__all__ = ["LEVELS", "Level", "Refused", "Workload"]
