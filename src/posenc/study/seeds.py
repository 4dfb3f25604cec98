"""Several training seeds of one row: where each run is kept, and their mean with its uncertainty.

The first seed's run is the row's entry itself (the layout a one-seed study always had); the runs of
seeds ``seed + 1``, ``seed + 2``, ... sit in ``entry["seeds"]``. Once two or more runs are done,
``entry["across_seeds"]`` holds per length:

- the mean over seeds (perplexity: ``exp`` of the mean loss, so the identities perplexity =
  exp(loss) and bits = loss / ln 2 hold for it too; recall: the mean accuracy),
- its 95% bootstrap interval, the windows resampled alike for every seed (:mod:`.bootstrap`): the
  uncertainty from the finite evaluation text, for the seed mean,
- the spread between seeds: each seed's number, their standard deviation (n - 1), min and max: the
  training noise, which the interval above does not contain.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from . import bootstrap
from .results import Paths


def runs(entry: dict) -> list[dict]:
    return [entry, *entry.get("seeds", [])]


def load_windows(paths: Paths, stem: str, seed: int, length: int) -> dict | None:
    path = paths.window_scores(stem, seed, length)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _spread(values: list[float]) -> dict:
    return {"seed_values": values, "seed_sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "seed_min": min(values), "seed_max": max(values)}


def aggregate(entry: dict, stem: str, paths: Paths, recall: bool) -> None:
    """Set ``entry["across_seeds"]`` from its finished runs (two or more), else remove it."""
    done = [r for r in runs(entry) if r.get("status") == "done"]
    if len(done) < 2:
        entry.pop("across_seeds", None)
        return
    seeds = [r["seed"] for r in done]
    lengths = sorted({row["length"] for r in done for row in r["eval"]})
    scores = []
    for length in lengths:
        found = [next((row for row in r["eval"] if row["length"] == length), None) for r in done]
        per = [p for p in found if p is not None]
        if len(per) < len(found):
            continue
        windows = [load_windows(paths, stem, s, length) for s in seeds]
        scores.append(_recall_score(length, per, windows) if recall else _lm_score(length, per, windows))
    train = [r.get("train") or {} for r in done]
    entry["across_seeds"] = {"seeds": seeds, "eval": scores, "train": _train(train)}


def _lm_score(length: int, per: list[dict], windows: list[dict | None]) -> dict:
    row = {"length": length, "seeds": len(per), "status": per[0]["status"]}
    if any(p.get("loss") is None for p in per):
        return {**row, "perplexity": None, "bits_per_byte": None, "loss": None, "tokens": per[0].get("tokens")}
    loss = sum(p["loss"] for p in per) / len(per)
    row.update(loss=loss, perplexity=bootstrap.exp(loss), bits_per_byte=loss / 0.6931471805599453,
               tokens=per[0]["tokens"])
    known = [w for w in windows if w is not None]
    if len(known) == len(windows):
        nll = [w["nll"] for w in known]
        count = [w["count"] for w in known]
        row["ppl_low"], row["ppl_high"] = bootstrap.interval(nll, count, bootstrap.exp)
    row.update(_spread([p["perplexity"] for p in per]))
    return row


def _recall_score(length: int, per: list[dict], windows: list[dict | None]) -> dict:
    row = {"length": length, "seeds": len(per), "status": per[0]["status"]}
    if any(p.get("accuracy") is None for p in per):
        return {**row, "accuracy": None}
    row["accuracy"] = sum(p["accuracy"] for p in per) / len(per)
    row.update(_spread([p["accuracy"] for p in per]))
    distances = {}
    known = [w for w in windows if w is not None]
    for cls, first in per[0]["distances"].items():
        d = {k: first[k] for k in ("queries", "distance_min", "distance_max")}
        d["accuracy"] = sum(p["distances"][cls]["accuracy"] for p in per) / len(per)
        if len(known) == len(windows):
            correct = [w[cls]["correct"] for w in known]
            count = [w[cls]["count"] for w in known]
            d["acc_low"], d["acc_high"] = bootstrap.interval(correct, count)
        d.update(_spread([p["distances"][cls]["accuracy"] for p in per]))
        distances[cls] = d
    row["distances"] = distances
    if len(known) == len(windows):
        correct = [sum((w[c]["correct"] for c in distances), []) for w in known]
        count = [sum((w[c]["count"] for c in distances), []) for w in known]
        row["acc_low"], row["acc_high"] = bootstrap.interval(correct, count)
    return row


def _train(records: list[dict]) -> dict:
    """Mean training record over seeds (the loss curve averaged step by step)."""
    records = [r for r in records if r]
    if not records:
        return {}
    out: dict[str, Any] = {"seeds": len(records)}
    for key in ("steps", "tokens"):
        if key in records[0]:
            out[key] = records[0][key]
    for key in ("time_s", "tokens_per_s", "final_loss"):
        values = [r[key] for r in records if key in r]
        if values:
            out[key] = sum(values) / len(values)
    curves = [r["losses"] for r in records if r.get("losses")]
    if curves:
        n = min(map(len, curves))
        out["losses"] = [round(sum(c[i] for c in curves) / len(curves), 5) for i in range(n)]
    if "final_loss" in out:
        out.update({f"final_loss_{k.removeprefix('seed_')}": v
                    for k, v in _spread([r["final_loss"] for r in records]).items() if k != "seed_values"})
    return out


def path_of(paths: Paths, stem: str, index: int, seed: int) -> Path:
    """The checkpoint of the ``index``-th seed's run of a row."""
    return paths.checkpoint(stem, None if index == 0 else seed)


__all__ = ["aggregate", "load_windows", "path_of", "runs"]
