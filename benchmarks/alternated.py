"""Alternated rounds: the timing loop of the floor benchmarks (pope_floor.py, bias_floor.py).

Every job runs once untimed, then once a round in an order that rotates from round to round; a
job's ratio to ``nope`` is taken inside its round, so the times a ratio compares ran seconds apart.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Callable


def alternated(run: dict[str, Callable[[], None]], rounds: int, label: str = "") -> dict[str, dict[str, float]]:
    """Time each job of ``run`` (which must hold ``"nope"``) over ``rounds`` alternated rounds.

    Returns:
        job -> {"seconds": median seconds, "ratio": median ratio to nope, "ratio_min", "ratio_max"}.
    """
    names = list(run)
    for fn in run.values():  # one untimed call each
        fn()
    seconds: dict[str, list[float]] = {m: [] for m in names}
    ratios: dict[str, list[float]] = {m: [] for m in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        took = {}
        for m in order:
            start = time.perf_counter()
            run[m]()
            took[m] = time.perf_counter() - start
            seconds[m].append(took[m])
        for m in names:
            ratios[m].append(took[m] / took["nope"])
        print(f"{label}round {r + 1}/{rounds}: " + ", ".join(f"{m} {took[m] / took['nope']:.2f}x" for m in names), file=sys.stderr)
    return {m: {"seconds": statistics.median(seconds[m]), "ratio": statistics.median(ratios[m]),
                "ratio_min": min(ratios[m]), "ratio_max": max(ratios[m])} for m in names}
