"""What a study shows while it runs: tqdm bars on a terminal (one for the study, one per method),
plain log lines with an ETA otherwise (a log file, CI), nothing with ``progress=False``."""

from __future__ import annotations

import contextlib
import sys
import time


class Progress:
    """tqdm bars on a terminal (one for the study, one per method); plain log lines otherwise."""

    def __init__(self, enabled: bool, bars: bool | None = None) -> None:
        self.enabled = enabled
        self.bars = enabled and (sys.stderr.isatty() if bars is None else bars)
        self.study = None
        self._last_log = 0

    def study_bar(self, total: int, done: int) -> None:
        if self.bars:
            from tqdm import tqdm

            self.study = tqdm(total=total, initial=done, desc="study", unit="method", position=0, dynamic_ncols=True)

    def method_bar(self, method: str, total: int, start: int):
        self._every = max(1, total // 10)
        self._t0, self._start = time.perf_counter(), start
        if not self.bars:
            return None
        from tqdm import tqdm

        return tqdm(total=total, initial=start, desc=method, unit="step", position=1, leave=False, dynamic_ncols=True)

    def step(self, bar, method: str, done: int, total: int, loss: float, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
        elif done % self._every == 0 or done == total:
            rate = (done - self._start) / max(time.perf_counter() - self._t0, 1e-9)
            eta = (total - done) / max(rate, 1e-9)
            self.log(f"[{method}] step {done}/{total} loss {loss:.3f} {tokens_per_s:,.0f} tok/s eta {eta:.0f}s")

    def eval_bar(self, method: str, total: int, done: int):
        if not self.bars:
            return None
        from tqdm import tqdm

        return tqdm(total=total, initial=done, desc=f"{method} eval", unit="length", position=1, leave=False, dynamic_ncols=True)

    def evaluating(self, bar, length: int) -> None:
        if bar is not None:
            bar.set_postfix_str(f"L={length}")

    def advance(self, bar) -> None:
        if bar is not None:
            bar.update(1)

    def close(self, bar) -> None:
        if bar is not None:
            bar.close()

    @contextlib.contextmanager
    def closing(self, bar):
        try:
            yield bar
        finally:
            if bar is not None:
                bar.close()

    def method_done(self) -> None:
        if self.study is not None:
            self.study.update(1)

    def log(self, msg: str) -> None:
        if not self.enabled:
            return
        if self.bars:
            from tqdm import tqdm

            tqdm.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def finish(self) -> None:
        if self.study is not None:
            self.study.close()
