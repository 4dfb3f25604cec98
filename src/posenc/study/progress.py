"""What a study shows while it runs: tqdm bars on a terminal (the study, the method, the windows of
one evaluation length), plain log lines with an ETA otherwise (a log file, CI), nothing but warnings
with ``progress=False``.

A stage that will take long (training a method, or scoring one evaluation length) is announced
with an estimate once its first steps or batches are timed, even with ``progress=False``: a user
who asked for a million-token evaluation learns within seconds that it takes an hour.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

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
class _Scoring:
    """What :meth:`Progress.window_bar`'s callbacks share while one length is scored."""

    last_log: float  # when the last log line was printed (perf_counter)
    bar: Any = None  # a tqdm bar, once the first batch says there is time for one
    announced: bool = False  # the estimate after the first batch was made


class Progress:
    """Bars on a terminal, log lines otherwise; ``warn`` always prints (on the main process)."""

    def __init__(self, enabled: bool, bars: bool | None = None, main: bool = True) -> None:
        self.enabled = enabled and main
        self.main = main
        self.bars = self.enabled and (sys.stderr.isatty() if bars is None else bars)
        self.study = None

    def _tqdm(self, **kwargs: Any) -> Any:  # a tqdm bar (tqdm is untyped)
        from tqdm import tqdm

        return tqdm(dynamic_ncols=True, **kwargs)

    def study_bar(self, total: int, done: int = 0) -> None:
        if self.bars:
            self.study = self._tqdm(total=total, initial=done, desc="study", unit="method", position=0)

    def method_bar(self, method: str, total: int, start: int) -> Any:
        self._every = max(1, total // 10)
        self._t0, self._start, self._announced = time.perf_counter(), start, False
        if not self.bars:
            return None
        return self._tqdm(total=total, initial=start, desc=method, unit="step", position=1, leave=False)

    def step(self, bar: Any, method: str, done: int, total: int, loss: float, tokens_per_s: float) -> None:
        rate = (done - self._start) / max(time.perf_counter() - self._t0, 1e-9)
        eta = (total - done) / max(rate, 1e-9)
        if not self._announced and done - self._start >= 2:  # the first step pays for warm-up
            self._announced = True
            if eta > LONG_S:
                self.warn(f"[{method}] training will take about {duration(eta)} more "
                          f"({total - done} steps at {1 / max(rate, 1e-9):.2f} s/step)")
        if not self.enabled:
            return
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
        elif done % self._every == 0 or done == total:
            self.log(f"[{method}] step {done}/{total} loss {loss:.3f} {tokens_per_s:,.0f} tok/s eta {duration(eta)}")

    def eval_bar(self, method: str, total: int, done: int) -> Any:
        if not self.bars:
            return None
        return self._tqdm(total=total, initial=done, desc=f"{method} eval", unit="length", position=1, leave=False)

    def evaluating(self, bar: Any, length: int) -> None:
        if bar is not None:
            bar.set_postfix_str(f"L={length}")

    def window_bar(self, method: str, length: int) -> tuple[Callable[[int, int], None], Callable[[], None]]:
        """(on_batch, close) for scoring one length: a bar or log lines with an ETA, and an
        estimate after the first batch when the length will take long."""
        t0 = time.perf_counter()
        state = _Scoring(last_log=t0)

        def on_batch(done: int, total: int) -> None:
            now = time.perf_counter()
            eta = (now - t0) / done * (total - done)
            if not state.announced:
                state.announced = True
                if eta > LONG_S:
                    self.warn(f"[{method}] L={length}: scoring {total:,} windows will take about {duration(eta)} "
                              f"(from the first batch); an interrupt loses only this length")
                if self.bars:
                    state.bar = self._tqdm(total=total, initial=done, desc=f"L={length}", unit="window",
                                              position=2, leave=False)
                    return
            if state.bar is not None:
                state.bar.update(done - state.bar.n)
            elif self.enabled and done < total and now - state.last_log >= LOG_EVERY_S:
                state.last_log = now
                self.log(f"[{method}] L={length}: {done:,}/{total:,} windows, eta {duration(eta)}")

        def close() -> None:
            if state.bar is not None:
                state.bar.close()

        return on_batch, close

    def advance(self, bar: Any) -> None:
        if bar is not None:
            bar.update(1)

    def close(self, bar: Any) -> None:
        if bar is not None:
            bar.close()

    @contextlib.contextmanager
    def closing(self, bar: Any) -> Iterator[Any]:
        try:
            yield bar
        finally:
            if bar is not None:
                bar.close()

    def method_done(self) -> None:
        if self.study is not None:
            self.study.update(1)

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

    def finish(self) -> None:
        if self.study is not None:
            self.study.close()
