"""Two studies side by side (``posenc report RUN_A RUN_B``).

- Same task, scored on the same windows (same corpus, validation bytes, sliding stride and
  evaluation lengths for a language-model study; same training length, evaluation lengths and
  sequence count for recall): per row present in both and per length, A, B and B - A with a paired
  95% bootstrap interval (:func:`posenc.study.bootstrap.difference`: each resample draws the same
  windows for both runs, so the text's own difficulty cancels and only the models' difference is
  left). Any other difference of configuration (steps, seed, model size, ...) is listed above the
  table: it is what the comparison is about. Runs scored on different windows are refused, with what
  differs: their numbers cannot be paired.
- One language-model study and one recall study: a combined summary per row (perplexity from the
  first, recall from the second), the two axes the question needs.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ..errors import UsageError
from . import bootstrap, rows, seeds
from .results import Paths, metric_of, shown

# What decides the windows a number was scored on: equal in both runs, or no pairing is possible.
WINDOWS_LM = ("task", "valid_bytes", "sliding", "eval_lengths", "data")
WINDOWS_RECALL = ("task", "train_length", "eval_lengths", "recall_sequences")
IGNORED = ("methods", "device", "preset")  # where it ran, and what it was started from, not what it is


def config_diff(a: dict, b: dict, keys: Iterable[str] | None = None) -> list[str]:
    """'key: A -> B' for each config field that differs (all fields, or ``keys``)."""
    a, b = a["config"], b["config"]
    names = keys or sorted((set(a) | set(b)) - set(IGNORED))
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in names if a.get(k) != b.get(k)]


def check_pairable(a: dict, b: dict, name_a: str, name_b: str) -> list[str]:
    """UsageError when runs of one task were scored on different windows; else the config
    differences to state (besides the methods).

    Raises:
        UsageError: the two runs were scored on different windows, so a pairwise comparison would
            be meaningless.
    """
    keys = WINDOWS_RECALL if metric_of(a) == "accuracy" else WINDOWS_LM
    blocking = config_diff(a, b, keys)
    if metric_of(a) != "accuracy" and a.get("corpus", {}).get("valid_sha256") != b.get("corpus", {}).get("valid_sha256"):
        blocking.append("the validation text (valid_sha256)")
    if blocking:
        raise UsageError(f"{name_a} and {name_b} were scored on different windows ({'; '.join(blocking)}), so their "
                         "numbers cannot be compared pairwise; compare runs of the same data and evaluation settings")
    return config_diff(a, b)


def _windows(results: dict, root: Path, method: str, length: int) -> list[dict] | None:
    """The per-window numbers of every finished seed of ``method`` at ``length``; None if any is missing."""
    entry = results["methods"][method]
    stem = rows.parse(method).stem
    out = []
    for run in seeds.runs(entry):
        if run.get("status") != "done":
            continue
        w = seeds.load_windows(Paths(root), stem, run.get("seed", results.get("seed", 0)), length)
        if w is None:
            return None
        out.append(w)
    return out or None


def differences(a: dict, root_a: Path, b: dict, root_b: Path) -> list[dict]:
    """Per common row and length: {"method", "length", "a", "b", "diff", "low", "high"} (perplexity, or
    far-distance accuracy for recall); low/high None when a window file is missing."""
    recall = metric_of(a) == "accuracy"
    out = []
    for method in [m for m in a["methods"] if m in b["methods"]]:
        rows_a = {r["length"]: r for r in shown(a["methods"][method])}
        rows_b = {r["length"]: r for r in shown(b["methods"][method])}
        for length in sorted(set(rows_a) & set(rows_b)):
            ra, rb = rows_a[length], rows_b[length]
            va = ra["distances"]["far"]["accuracy"] if recall and ra.get("accuracy") is not None else ra.get("perplexity")
            vb = rb["distances"]["far"]["accuracy"] if recall and rb.get("accuracy") is not None else rb.get("perplexity")
            item = {"method": method, "length": length, "a": va, "b": vb, "diff": None, "low": None, "high": None}
            if va is not None and vb is not None:
                item["diff"] = vb - va
                wa, wb = _windows(a, root_a, method, length), _windows(b, root_b, method, length)
                if wa and wb:
                    if recall:
                        args = ([w["far"]["correct"] for w in wa], [w["far"]["count"] for w in wa],
                                [w["far"]["correct"] for w in wb], [w["far"]["count"] for w in wb])
                        item["diff"], item["low"], item["high"] = bootstrap.difference(*args)
                    else:
                        args = ([w["nll"] for w in wa], [w["count"] for w in wa], [w["nll"] for w in wb],
                                [w["count"] for w in wb])
                        item["diff"], item["low"], item["high"] = bootstrap.difference(*args, transform=bootstrap.exp)
            out.append(item)
    return out


__all__ = ["IGNORED", "WINDOWS_LM", "WINDOWS_RECALL", "check_pairable", "config_diff", "differences"]
