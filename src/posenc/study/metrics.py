"""What the score stage of a study makes of one run at one evaluation length: a typed record,
written into results.json as one row of the run's ``eval`` list (:meth:`Score.to_json`).

- :class:`LMScore` (language model): perplexity of the validation text with its 95% bootstrap
  interval over the scored windows, bits per byte, mean loss (nats per token), tokens scored and
  the number of windows.
- :class:`RecallScore` (associative recall): accuracy over every query with its interval (the
  bootstrap over sequences), and per distance class (near, middle, far) its accuracy, interval,
  query count and the distances it spans.

A length the model cannot run (a learned table shorter than the length, say) is a record whose
metrics are None and whose ``status`` says why; otherwise ``status`` is ``"ok"``. Both kinds carry
what the stage adds around the metric: the position parameters used but never trained
(:mod:`.fairness`), the evaluation variant's settings (:mod:`.variants`) and the time the length
took. The keys of ``to_json`` are those :mod:`.results` documents for an evaluation row.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True)
class Score(ABC):
    """One evaluation length of one run, the part every task shares."""

    length: int  # the evaluation length (tokens per window or sequence)
    status: str = "ok"  # "ok", or why the model cannot run at this length
    untrained: list[dict] | None = None  # position parameters used here that training never updated
    variant: dict[str, Any] = field(default_factory=dict)  # the evaluation variant's settings (block_size, scaling)
    time_s: float | None = None  # seconds this length took

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def _tail(self, out: dict) -> dict:
        out["status"] = self.status
        if self.untrained is not None:
            out["untrained"] = self.untrained
        out.update(self.variant)
        if self.time_s is not None:
            out["time_s"] = self.time_s
        return out

    @abstractmethod
    def to_json(self) -> dict:
        """The row of results.json's ``eval`` list: the kind's metric first, then :meth:`_tail`'s keys."""

    @abstractmethod
    def log_line(self) -> str:
        """The record in words, for the log."""


@dataclass(kw_only=True)
class LMScore(Score):
    """A language model's perplexity at one length."""

    tokens: int  # validation tokens scored (the corpus' own count when the length cannot run)
    perplexity: float | None = None
    ppl_low: float | None = None  # 95% bootstrap interval over the scored windows
    ppl_high: float | None = None
    bits_per_byte: float | None = None
    loss: float | None = None  # mean negative log-likelihood, nats per token
    windows: int | None = None  # windows scored

    def to_json(self) -> dict:
        out: dict[str, Any] = {"length": self.length, "perplexity": self.perplexity}
        if self.ok:
            out.update(ppl_low=self.ppl_low, ppl_high=self.ppl_high)
        out.update(bits_per_byte=self.bits_per_byte, loss=self.loss, tokens=self.tokens)
        if self.ok:
            out["windows"] = self.windows
        return self._tail(out)

    def log_line(self) -> str:
        """The record in words, for the log."""
        if not self.ok:
            return self.status
        return (f"perplexity {self.perplexity:.3f} [{self.ppl_low:.3f}, {self.ppl_high:.3f}], "
                f"{self.bits_per_byte:.3f} bits/byte")


@dataclass(kw_only=True)
class RecallScore(Score):
    """Associative recall's accuracy at one length, over all queries and per distance class."""

    accuracy: float | None = None
    acc_low: float | None = None  # 95% bootstrap interval over sequences
    acc_high: float | None = None
    # per class (near, middle, far): accuracy, acc_low, acc_high, queries, distance_min, distance_max
    distances: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> dict:
        out: dict[str, Any] = {"length": self.length, "accuracy": self.accuracy}
        if self.ok:
            out.update(acc_low=self.acc_low, acc_high=self.acc_high, distances=self.distances)
        return self._tail(out)

    def log_line(self) -> str:
        """The record in words, for the log."""
        if not self.ok:
            return self.status
        far = self.distances["far"]
        return (f"accuracy {self.accuracy:.3f} [{self.acc_low:.3f}, {self.acc_high:.3f}], far "
                f"{far['accuracy']:.3f} (distance {far['distance_min']}-{far['distance_max']})")


__all__ = ["LMScore", "RecallScore", "Score"]
