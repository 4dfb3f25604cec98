"""What a benchmark level is: sizes, modes, and how a worker builds the step it times.

A level is one :class:`Level` value in its own module, registered in
:data:`posenc.bench.levels.LEVELS`. The harness plans jobs from its ``modes`` and ``sizes``; the
worker calls its ``build`` to get a :class:`Workload` (the step to time, and the module that holds
the ``posenc.Attention`` layers, read afterwards for the backend each one ran).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ...model.schedule import Schedule
from ..job import Job


def schedule_of(method: str, depth: int) -> Schedule | None:
    """A method written as a layer schedule (its text form, ``3x[rope window=256] 1x[rope]``),
    repeated to ``depth`` layers; None for a registered method's name."""
    return Schedule.parse(method, depth) if "[" in method else None


class Refused(Exception):
    """A compared library refuses this configuration (raised while building it): not a failure."""


@dataclass(frozen=True)
class Workload:
    """The step a worker times, and the module whose ``posenc.Attention`` layers it reads.

    ``module`` is None for a compared library: there is no posenc backend to report.
    """

    step: Callable[[], None]
    module: nn.Module | None = None


def tokens_per_step(job: Job) -> int:
    """Tokens a step processes: the whole (B, N) batch (a decode level would return B)."""
    return job.batch * job.length


@dataclass(frozen=True)
class Level:
    """One level of ``posenc bench``.

    Args:
        name: the ``level`` option's value.
        summary: one line for ``--help``.
        modes: the modes it measures, in table order.
        sizes: default dim, heads, batch, depth, vocab.
        build: (job, device, dtype) -> the workload; runs in the worker.
        describe: sizes -> the words the table title uses for what is measured.
        units: mode -> the unit of its time column (default "s").
        compare: libraries (:data:`posenc.bench.libraries.LIBRARIES`) it can be compared with.
        tokens: job -> tokens per step, for tokens/s.
    """

    name: str
    summary: str
    modes: tuple[str, ...]
    sizes: dict[str, int]
    build: Callable[[Job, torch.device, torch.dtype], Workload]
    describe: Callable[[dict], str]
    units: dict[str, str] = field(default_factory=dict)
    compare: tuple[str, ...] = ()
    tokens: Callable[[Job], int] = tokens_per_step

    def unit(self, mode: str) -> str:
        return self.units.get(mode, "s")
