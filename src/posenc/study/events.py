"""What a run reports while it works: small records that training, evaluation and the stages hand
to one callable (:data:`Report`), passed down from the top of the run. They say what happened, not
how to show it: the top of the run turns them into bars or log lines (:class:`.progress.Progress`),
a worker sends the lines to the main process (:mod:`.worker`), a test stops a run at a step.

In the order a run reports them:

    StudyStarted   a study's runs are about to run (skipped ones included)
    TrainStarted   a training loop begins (at ``start`` of ``steps``: above 0 when resumed)
    StepDone       one training step finished, with its loss and throughput so far
    TrainEnded     the training loop is left (finished, interrupted or failed)
    ScoringStarted a run's evaluation lengths are about to be scored
    LengthStarted  one length's windows are about to be scored
    WindowsScored  a batch of that length's windows is scored (this process's share)
    LengthScored   one length is scored (its one-line summary)
    ScoringEnded   the run's scoring is left
    SearchScored   one individual of LongRoPE's search is scored (:mod:`.longrope_search`)
    RunDone        a run (a row at a seed) is finished, trained and scored or recorded diverged
    StudyEnded     the study's runs are left (all finished, or one failed or was interrupted)
    Log            a line for the user when progress is shown
    Warn           a line for the user even with progress off
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union


@dataclass(frozen=True)
class StudyStarted:
    runs: int  # every run of the study (or of its part), those a resumed study finished too


@dataclass(frozen=True)
class TrainStarted:
    label: str  # the run's name in progress lines
    steps: int  # the last step
    start: int  # the first step done now (a resumed run's saved step; 0 for a new run)


@dataclass(frozen=True)
class StepDone:
    label: str
    step: int  # steps done (1-based)
    steps: int
    loss: float  # this step's mean loss over the processes
    tokens_per_s: float  # training tokens per second since the run began


@dataclass(frozen=True)
class TrainEnded:
    label: str


@dataclass(frozen=True)
class ScoringStarted:
    label: str
    lengths: int  # the evaluation lengths in all
    done: int  # of them scored before (a resumed run)


@dataclass(frozen=True)
class LengthStarted:
    label: str
    length: int


@dataclass(frozen=True)
class WindowsScored:
    done: int  # windows scored so far at the current length (this process's share)
    total: int


@dataclass(frozen=True)
class LengthScored:
    label: str
    length: int
    summary: str  # the score in one line (:meth:`.metrics.Score.log_line`)


@dataclass(frozen=True)
class ScoringEnded:
    label: str


@dataclass(frozen=True)
class SearchScored:
    generation: int  # the individual's generation (0: the first population)
    generations: int
    evaluated: int  # individuals evaluated so far (a resumed search's too)
    perplexity: float  # this one's (inf or NaN where the model's was not finite)
    best: float  # the lowest so far (NaN: none finite yet)
    seconds: float  # what scoring this one took


@dataclass(frozen=True)
class RunDone:
    label: str


@dataclass(frozen=True)
class StudyEnded:
    pass


@dataclass(frozen=True)
class Log:
    text: str


@dataclass(frozen=True)
class Warn:
    text: str


Event = Union[StudyStarted, TrainStarted, StepDone, TrainEnded, ScoringStarted, LengthStarted, WindowsScored,
              LengthScored, ScoringEnded, SearchScored, RunDone, StudyEnded, Log, Warn]
Report = Callable[[Event], None]  # where a run's events go


def ignore(event: Event) -> None:
    """A :data:`Report` that drops every event (a caller that shows nothing)."""


__all__ = ["Event", "Log", "LengthScored", "LengthStarted", "Report", "RunDone", "ScoringEnded", "ScoringStarted",
           "SearchScored", "StepDone", "StudyEnded", "StudyStarted", "TrainEnded", "TrainStarted", "Warn", "WindowsScored", "ignore"]
