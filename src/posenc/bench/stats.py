"""Ratios you can trust: per-round ratios to the NoPE of the same round, their median and spread.

Every job of a table runs once per round, and each round has its own NoPE. A method's ratio in a
round is its time (or memory) divided by NoPE's in that round, at the same level, mode and length;
the table reports the median of those ratios over the rounds and their spread (min-max). Slow
drifts of the machine (another process, thermal state) then move a method and its NoPE together,
and one disturbed round moves the median little. The control row (NoPE measured again as if it
were another method) goes through the same arithmetic: it must read 1.00x within its spread, and
its spread is the noise floor of the table.
"""

from __future__ import annotations

import statistics

from .job import BASELINE, POSENC, cell_key, label

RATIO_KEYS = ("median_s", "tokens_per_s", "peak_mb", "increase_mb")  # each gets a *_vs_nope ratio
MEDIAN_KEYS = ("median_s", "tokens_per_s", "baseline_mb", "peak_mb", "increase_mb")  # medians over rounds
JOB_KEYS = (
    "level", "mode", "length", "method", "impl", "control", "dim", "heads", "batch", "depth", "vocab", "repeats",
    "warmup", "device", "dtype", "backend", "threads",
)


def spread(values: list[float | None]) -> tuple[float | None, float | None, float | None]:
    """(median, min, max) of the values that are not None; (None, None, None) if there are none."""
    present = [v for v in values if v is not None]
    if not present:
        return None, None, None
    return statistics.median(present), min(present), max(present)


def _ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    if a is None or b is None or a.get("status") != "ok" or b.get("status") != "ok":
        return None
    return a[key] / b[key] if b[key] > 0 else None


def _summarize_cell(records: list[dict], rounds: list[int], base: dict, posenc: dict) -> dict:
    """One table cell from its records (one per round), ``rounds`` the table's round numbers."""
    first = records[0]
    by_round = {r.get("round", 0): r for r in records}
    row = {k: first.get(k) for k in JOB_KEYS if k in first}
    row["control"] = bool(first.get("control"))
    row["label"] = label(first)
    ok = [r for r in records if r.get("status") == "ok"]
    row["rounds"] = len(records)
    row["rounds_ok"] = len(ok)
    if ok:
        row["status"] = "ok"
    else:
        row["status"] = next((s for s in ("refused", "n/a") if any(r.get("status") == s for r in records)), "failed")
    errors = [r["error"] for r in records if r.get("status") != "ok" and r.get("error")]
    if errors:
        row["error"] = "; ".join(dict.fromkeys(errors))
    for key in MEDIAN_KEYS:  # every round's figure, None where the round failed
        per_round = [by_round[i][key] if by_round.get(i, {}).get("status") == "ok" else None for i in rounds]
        row[f"round_{key}"] = per_round
        row[key] = spread(per_round)[0]
    row["min_s"] = min((t for r in ok for t in r.get("times_s", [r["median_s"]])), default=None)
    if ok:
        row["threads_used"] = ok[0].get("threads_used")
        used = {name for r in ok for name in str(r.get("backend_used", "-")).split("+")}
        row["backend_used"] = "+".join(sorted(used))
    group = (first["level"], first["mode"], first["length"])
    for key in RATIO_KEYS:
        ratios = [_ratio(by_round.get(i), base.get((*group, i)), key) for i in rounds]
        row[f"{key}_vs_nope_rounds"] = ratios
        row[f"{key}_vs_nope"], row[f"{key}_vs_nope_lo"], row[f"{key}_vs_nope_hi"] = spread(ratios)
    if first["impl"] != POSENC:  # a compared library against posenc's same method, round by round
        ratios = [_ratio(by_round.get(i), posenc.get((*group, first["method"], i)), "median_s") for i in rounds]
        row["median_s_vs_posenc_rounds"] = ratios
        row["median_s_vs_posenc"], row["median_s_vs_posenc_lo"], row["median_s_vs_posenc_hi"] = spread(ratios)
    return row


def summarize(records: list[dict]) -> list[dict]:
    """One row per table cell (level, mode, length, method, impl, control), in the records' order.

    Each row holds the medians over rounds (``median_s``: the median of each round's median time),
    every round's figure (``round_median_s``, ..., None where that round failed) and, for each of
    :data:`RATIO_KEYS`, ``KEY_vs_nope`` (median over rounds of the round's ratio to its NoPE),
    ``KEY_vs_nope_lo`` / ``_hi`` (min and max over rounds) and ``KEY_vs_nope_rounds``. Rows of a
    compared library also get ``median_s_vs_posenc`` (its time / posenc's for the same method).
    A record without a ``round`` is round 0.
    """
    base, posenc = {}, {}
    for r in records:
        if r["impl"] == POSENC and not r.get("control"):
            posenc[(r["level"], r["mode"], r["length"], r["method"], r.get("round", 0))] = r
            if r["method"] == BASELINE:
                base[(r["level"], r["mode"], r["length"], r.get("round", 0))] = r
    rounds = sorted({r.get("round", 0) for r in records})
    cells: dict[tuple, list[dict]] = {}
    for r in records:
        cells.setdefault(cell_key(r), []).append(r)
    return [_summarize_cell(rs, rounds, base, posenc) for rs in cells.values()]
