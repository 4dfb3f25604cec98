"""Confidence intervals from the evaluation itself: a bootstrap over scored windows (Efron &
Tibshirani 1993, "An Introduction to the Bootstrap", ch. 13, the percentile interval).

A study's number at one length is a ratio: the NLL summed over every scored target, divided by the
number of targets (perplexity is its exponential), or the correct answers divided by the queries
(recall accuracy). The units that were scored independently of each other are the windows (the
scored segments of a sliding evaluation, the sequences of the recall task): resampling them with
replacement, ``RESAMPLES`` times, and recomputing the ratio each time gives the spread the number
would have on another draw of text of the same kind, with no extra training.

- Every interval uses the same resamples for a given number of windows (the generator is seeded by
  ``SEED`` and the window count), so an interval repeats exactly, and two methods scored on the same
  windows are resampled alike: their difference can be bootstrapped paired (:func:`difference`).
- With several training seeds the statistic is the mean over seeds of each seed's ratio, the
  windows resampled once for all seeds: the interval is that of the seed mean for the text drawn;
  the spread between seeds (the training noise) is reported beside it, not folded in.
- Adjacent windows of one file are not independent; the interval treats them as if they were, so
  it is somewhat too narrow when the validation text is made of few long files.

Shape legend: S seeds (or runs), W windows, R resamples.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import numpy.typing as npt

RESAMPLES = 2000
LEVEL = 0.95
SEED = 20231208
_CHUNK_CELLS = 1 << 22  # resample x window cells per chunk: bounds memory for sliding windows


def _as_matrix(values: npt.ArrayLike) -> np.ndarray:
    a = np.asarray(values, dtype=np.float64)
    return a[None, :] if a.ndim == 1 else a  # (S, W)


def _resampled_ratios(num: np.ndarray, den: np.ndarray, resamples: int, seed: int) -> np.ndarray:
    """(R,) mean over the S rows of sum(num[s, idx]) / sum(den[s, idx]), idx one resample of W."""
    s, w = num.shape
    rng = np.random.default_rng([seed, w])
    out = np.empty(resamples, dtype=np.float64)
    step = max(1, _CHUNK_CELLS // max(w * s, 1))
    for start in range(0, resamples, step):
        r = min(step, resamples - start)
        idx = rng.integers(0, w, size=(r, w))  # (r, W): the windows drawn by each resample
        ratios = num[:, idx].sum(axis=-1) / den[:, idx].sum(axis=-1)  # (S, r)
        out[start : start + r] = ratios.mean(axis=0)
    return out


def interval(num: npt.ArrayLike, den: npt.ArrayLike, transform: Callable[[float], float] = lambda v: v, *, level: float = LEVEL,
             resamples: int = RESAMPLES, seed: int = SEED) -> tuple[float, float]:
    """Percentile interval of ``transform(mean over seeds of sum(num) / sum(den))``.

    Args:
        num: (W,) or (S, W): per window, the NLL sum (or correct answers).
        den: the same shape: per window, the scored targets (or queries).
        transform: applied to each resampled ratio (``math.exp`` for perplexity); monotone.
    Returns:
        (low, high) at ``level``.
    """
    num, den = _as_matrix(num), _as_matrix(den)
    if num.shape != den.shape or num.shape[1] == 0:
        raise ValueError(f"num and den must have the same non-empty shape, got {num.shape} and {den.shape}")
    ratios = np.sort(_resampled_ratios(num, den, resamples, seed))
    lo, hi = np.quantile(ratios, [(1 - level) / 2, (1 + level) / 2])
    return float(transform(float(lo))), float(transform(float(hi)))


def point(num: npt.ArrayLike, den: npt.ArrayLike) -> float:
    """Mean over seeds of sum(num) / sum(den): the number the interval is about."""
    num, den = _as_matrix(num), _as_matrix(den)
    return float((num.sum(axis=1) / den.sum(axis=1)).mean())


def difference(num_a: npt.ArrayLike, den_a: npt.ArrayLike, num_b: npt.ArrayLike, den_b: npt.ArrayLike,
               transform: Callable[[float], float] = lambda v: v, *,
               level: float = LEVEL, resamples: int = RESAMPLES, seed: int = SEED) -> tuple[float, float, float]:
    """transform(B) - transform(A) and its paired percentile interval: A and B scored the same W
    windows (the same text at the same length), and each resample draws the same windows for both.

    Returns:
        (difference, low, high).
    """
    na, da, nb, db = map(_as_matrix, (num_a, den_a, num_b, den_b))
    if na.shape[1] != nb.shape[1]:
        raise ValueError(f"paired difference needs the same windows: {na.shape[1]} vs {nb.shape[1]}")
    ra = _resampled_ratios(na, da, resamples, seed)
    rb = _resampled_ratios(nb, db, resamples, seed)  # the same generator state: the same draws
    diffs = np.sort(np.vectorize(transform)(rb) - np.vectorize(transform)(ra))
    lo, hi = np.quantile(diffs, [(1 - level) / 2, (1 + level) / 2])
    return float(transform(point(nb, db)) - transform(point(na, da))), float(lo), float(hi)


def exp(v: float) -> float:
    """math.exp that saturates instead of raising (a resample of a diverged model)."""
    return math.exp(min(v, 700.0))


__all__ = ["LEVEL", "RESAMPLES", "SEED", "difference", "exp", "interval", "point"]
