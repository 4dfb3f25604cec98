"""What a run shows while it works, drawn at the top of the run from the events that training,
evaluation and the stages report (:mod:`.events`): tqdm bars on a terminal (the study, the method,
the windows of one evaluation length), plain log lines with an ETA otherwise (a log file, CI),
nothing but warnings with ``progress=False``.

A stage that will take long (training a method, or scoring one evaluation length) is announced
with an estimate once its first steps or batches are timed, even with ``progress=False``: a user
who asked for a million-token evaluation learns within seconds that it takes an hour.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

from .events import (
    Event,
    LengthScored,
    LengthStarted,
    Log,
    RunDone,
    ScoringEnded,
    ScoringStarted,
    SearchScored,
    StepDone,
    StudyEnded,
    StudyStarted,
    TrainEnded,
    TrainStarted,
    Warn,
    WindowsScored,
)

LONG_S = 60.0  # a stage projected to take longer than this is announced with an estimate
LOG_EVERY_S = 30.0  # plain log lines during a long evaluation length: at most this far apart


def duration(seconds: float) -> str:
    """45s, 3m05s, 2h10m."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


@dataclass
class _Training:
    """One training loop as it is shown: since when, from which step, its bar."""

    t0: float  # when the loop began (perf_counter)
    start: int  # its first step (a resumed run's saved one)
    every: int  # log a line every this many steps (no bar)
    bar: Any = None  # a tqdm bar (bars only)
    announced: bool = False  # the estimate after the first steps was made


@dataclass
class _Length:
    """One evaluation length as it is shown while its windows are scored."""

    label: str
    length: int
    t0: float  # when its scoring began (perf_counter)
    last_log: float  # when the last log line was printed
    bar: Any = None  # a tqdm bar, once the first batch says there is time for one
    announced: bool = False  # the estimate after the first batch was made


class Progress:
    """The events of a run (called as ``progress(event)``, a :data:`.events.Report`) as bars on a
    terminal, log lines otherwise; a warning always prints (on the main process)."""

    def __init__(self, enabled: bool, bars: bool | None = None, main: bool = True) -> None:
        self.enabled = enabled and main
        self.main = main
        self.bars = self.enabled and (sys.stderr.isatty() if bars is None else bars)
        self.study: Any = None  # the study's bar: its runs
        self._training: _Training | None = None
        self._scoring: Any = None  # the bar of a run's evaluation lengths
        self._length: _Length | None = None

    def _tqdm(self, **kwargs: Any) -> Any:  # a tqdm bar (tqdm is untyped)
        from tqdm import tqdm

        return tqdm(dynamic_ncols=True, **kwargs)

    def __call__(self, event: Event) -> None:
        match event:  # (in the order a run reports them)
            case StudyStarted():
                if self.bars:
                    self.study = self._tqdm(total=event.runs, desc="study", unit="method", position=0)
            case TrainStarted():
                self._train_started(event)
            case StepDone():
                self._step(event)
            case TrainEnded():
                self._close_training()
            case ScoringStarted():
                if self.bars:
                    self._scoring = self._tqdm(total=event.lengths, initial=event.done, desc=f"{event.label} eval",
                                               unit="length", position=1, leave=False)
            case LengthStarted():
                self._close_length()
                now = time.perf_counter()
                self._length = _Length(event.label, event.length, t0=now, last_log=now)
                if self._scoring is not None:
                    self._scoring.set_postfix_str(f"L={event.length}")
            case WindowsScored():
                self._windows(event)
            case LengthScored():
                self._close_length()
                self.log(f"[{event.label}] L={event.length}: {event.summary}")
                if self._scoring is not None:
                    self._scoring.update(1)
            case ScoringEnded():
                self._close_length()
                if self._scoring is not None:
                    self._scoring.close()
                    self._scoring = None
            case SearchScored():
                self.log(f"[longrope search] generation {event.generation}/{event.generations} individual "
                         f"{event.evaluated}: ppl {event.perplexity:.3f} (best {event.best:.3f}), {event.seconds:.2f}s")
            case RunDone():
                if self.study is not None:
                    self.study.update(1)
            case StudyEnded():
                if self.study is not None:
                    self.study.close()
                    self.study = None
            case Log():
                self.log(event.text)
            case Warn():
                self.warn(event.text)

    def _train_started(self, event: TrainStarted) -> None:
        self._close_training()
        if event.start:
            self.log(f"[{event.label}] resuming from step {event.start}/{event.steps}")
        bar = None
        if self.bars:
            bar = self._tqdm(total=event.steps, initial=event.start, desc=event.label, unit="step", position=1,
                             leave=False)
        self._training = _Training(time.perf_counter(), event.start, max(1, event.steps // 10), bar)

    def _step(self, event: StepDone) -> None:
        t = self._training
        if t is None:  # (a step reported without its loop's start: nothing to time it against)
            return
        done, total = event.step, event.steps
        rate = (done - t.start) / max(time.perf_counter() - t.t0, 1e-9)
        eta = (total - done) / max(rate, 1e-9)
        if not t.announced and done - t.start >= 2:  # the first step pays for warm-up
            t.announced = True
            if eta > LONG_S:
                self.warn(f"[{event.label}] training will take about {duration(eta)} more "
                          f"({total - done} steps at {1 / max(rate, 1e-9):.2f} s/step)")
        if not self.enabled:
            return
        if t.bar is not None:
            t.bar.update(1)
            t.bar.set_postfix(loss=f"{event.loss:.3f}", tok_s=f"{event.tokens_per_s:,.0f}", refresh=False)
        elif done % t.every == 0 or done == total:
            self.log(f"[{event.label}] step {done}/{total} loss {event.loss:.3f} {event.tokens_per_s:,.0f} tok/s "
                     f"eta {duration(eta)}")

    def _close_training(self) -> None:
        if self._training is not None and self._training.bar is not None:
            self._training.bar.close()
        self._training = None

    def _windows(self, event: WindowsScored) -> None:
        """A bar or log lines with an ETA for the length being scored, and an estimate after its
        first batch when it will take long."""
        state = self._length
        if state is None:  # (windows scored outside a study's length: nothing to show them against)
            return
        done, total = event.done, event.total
        now = time.perf_counter()
        eta = (now - state.t0) / done * (total - done)
        if not state.announced:
            state.announced = True
            if eta > LONG_S:
                self.warn(f"[{state.label}] L={state.length}: scoring {total:,} windows will take about "
                          f"{duration(eta)} (from the first batch); an interrupt loses only this length")
            if self.bars:
                state.bar = self._tqdm(total=total, initial=done, desc=f"L={state.length}", unit="window",
                                       position=2, leave=False)
                return
        if state.bar is not None:
            state.bar.update(done - state.bar.n)
        elif self.enabled and done < total and now - state.last_log >= LOG_EVERY_S:
            state.last_log = now
            self.log(f"[{state.label}] L={state.length}: {done:,}/{total:,} windows, eta {duration(eta)}")

    def _close_length(self) -> None:
        if self._length is not None and self._length.bar is not None:
            self._length.bar.close()
        self._length = None

    # -- lines ----------------------------------------------------------------------------------------

    def _print(self, msg: str) -> None:
        if self.bars:
            from tqdm import tqdm

            tqdm.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def log(self, msg: str) -> None:
        if self.enabled:
            self._print(msg)

    def warn(self, msg: str) -> None:
        """Something the user should know even with progress off (printed by the main process)."""
        if self.main:
            self._print(msg)


__all__ = ["LOG_EVERY_S", "LONG_S", "Progress", "duration"]
