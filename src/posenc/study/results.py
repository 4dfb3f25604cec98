"""A study's files: the layout of its output directory, ``results.json`` (read and checked), and the
tables and figure made from it.

    results.json          config, corpus fingerprint, versions, per row: loss curve, timing, eval
    results.csv           one line per row and evaluation length (recall: and distance class)
    results.md            the table printed at the end (rows x lengths, with 95% intervals)
    extrapolation.png     perplexity (recall: accuracy by distance) vs evaluation length
    checkpoints/R.safetensors + R.json    final weights + their LMConfig (posenc.load_checkpoint);
                          R.seedS.safetensors for the seeds after the first
    state/R.pt            training state while R trains (model, optimizer, scheduler, RNG, step)
    windows/R/sS-LN.json  per scored window at length N, seed S: NLL sum and count (recall: correct
                          answers and queries per sequence and distance class), what the intervals and
                          the two-run comparison resample
    .posenc-run           marker: posenc made this directory (it writes nowhere else)
    .posenc-lock          holds the pid of the run writing here (see posenc.files.RunDir)

An entry of ``results["methods"]`` (one per row, see :mod:`.rows`) is the run of the first seed,
with the same keys a one-seed study always had (status, model, parameters, checkpoint, train, eval),
plus ``row`` (what the row is), ``seeds`` (the runs of the other seeds, each {seed, status,
checkpoint, train, eval}) and, once two or more seeds are done, ``across_seeds`` ({seeds, train,
eval}: the mean over seeds with its bootstrap interval and the spread between seeds). Tables and
figures show ``across_seeds`` when present, else the first seed's rows (:func:`shown`). A run's
status is ``trained``, ``done`` or ``diverged`` (training met a non-finite loss, gradient or
activation: ``train`` holds ``diverged_at_step`` and ``reason``, ``eval`` is empty). results.json is
strict JSON, and :func:`load_results` refuses one whose numbers have the wrong type; file names made
from its row names and seeds stay inside the run directory (:class:`Paths`).

An evaluation row (language model): length, perplexity, ppl_low and ppl_high (the 95% bootstrap
interval over windows), bits_per_byte, loss, tokens, windows, status, time_s, and where they apply
``untrained`` (position parameters this length used that training never updated, see
:mod:`.fairness`) and ``scaling`` / ``block_size`` (an evaluation variant's settings). Recall rows:
length, accuracy, acc_low, acc_high (all distances), ``distances`` {near, middle, far: accuracy,
acc_low, acc_high, queries, distance_min, distance_max}, status, time_s.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from ..files import lock_holder, write_text
from . import figures

SCHEMA = "posenc-study/1"


@dataclass
class Paths:
    """Where each file of a study lives under its output directory."""

    root: Path

    @property
    def results(self) -> Path:
        return self.root / "results.json"

    def _inside(self, *parts: str) -> Path:
        """root / parts, refused (UsageError) unless every part is one plain file name: names read
        from results.json never become paths outside the run directory."""
        for part in parts:
            if not part or part in (".", "..") or "/" in part or "\\" in part or "\0" in part:
                raise UsageError(f"{self.results}: the file name {part!r} (from a row name or seed in it) is not a "
                                 "plain file name; it was edited or damaged")
        return self.root.joinpath(*parts)

    def checkpoint(self, stem: str, seed: int | None = None) -> Path:
        """The final weights of a row (``seed``: a seed after the first)."""
        return self._inside("checkpoints", f"{stem}.safetensors" if seed is None else f"{stem}.seed{seed}.safetensors")

    def state(self, stem: str, seed: int | None = None) -> Path:
        return self._inside("state", f"{stem}.pt" if seed is None else f"{stem}.seed{seed}.pt")

    def window_scores(self, stem: str, seed: int, length: int) -> Path:
        """The per-window numbers of a row's run at ``seed`` and ``length`` (the bootstrap's units)."""
        return self._inside("windows", stem, f"s{seed}-L{length}.json")


def load_results(out: str | Path) -> dict | None:
    """The results dict of the study in ``out``; None when it has no results.json yet;
    UsageError saying what is wrong when the file is not a study's results.

    Raises:
        UsageError: ``path`` is not valid JSON, has another schema than :data:`SCHEMA`, or is an
            incomplete (edited or damaged) study result.
    """
    path = Paths(Path(out)).results
    if not path.exists():
        return None
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UsageError(f"{path} is not valid JSON ({err}); it is damaged, or not a study's results") from None
    if not isinstance(results, dict) or results.get("schema") != SCHEMA:
        schema = results.get("schema") if isinstance(results, dict) else None
        raise UsageError(f"{path} is not a posenc study's results (schema {schema!r}, expected {SCHEMA!r})")
    problems = _problems(results)
    if problems:
        raise UsageError(f"{path} is not a complete posenc study result ({'; '.join(problems[:3])}); "
                         "it was edited or damaged")
    return results


# Fields a study from before they existed did not record: their value then was the default.
ADDED_FIELDS = {"task": "lm", "drop_positions_after": None, "random_positions": None, "finetune_steps": 0,
          "finetune_length": None, "recall_sequences": 64}


def check_resumable(saved: dict, comparable: dict, fingerprint: dict, hf: dict | None, out: Path) -> None:
    """Check that a study continued in ``out`` is the one saved there: the same model
    (``hf``: the architecture file's record, None for posenc's own), the same options (``comparable``:
    :meth:`.config.StudyConfig.comparable`; rows and seeds may be added) and the same data
    (``fingerprint``'s sha256).

    Raises:
        UsageError: naming what differs (the model file, each option with its saved and new value,
            the corpus' sha256) and how to go on.
    """
    before = saved.get("hf") or {}
    if before.get("sha256") != (hf or {}).get("sha256"):
        was = (f"hf_config {before.get('path')} (model_type {before.get('model_type')!r}, sha256 {before.get('sha256')})"
               if before else "posenc's own model (no hf_config)")
        now = (f"hf_config {hf['path']} (model_type {hf['model_type']!r}, sha256 {hf['sha256']})" if hf
               else "posenc's own model (no hf_config)")
        raise UsageError(f"resume: {out} was trained on {was}, this run asks for {now}; use the original "
                         "config file or another out")
    old = {**ADDED_FIELDS, **{k: v for k, v in saved["config"].items() if k not in ("methods", "seeds", "hf_config")}}
    diff = [f"{k}: {old.get(k)!r} -> {comparable.get(k)!r}" for k in sorted(set(old) | set(comparable))
            if old.get(k) != comparable.get(k)]
    if diff:
        raise UsageError(f"resume: {out} was run with a different config ({'; '.join(diff)}); "
                         "use the original options or another out")
    if saved.get("corpus", {}).get("sha256") != fingerprint["sha256"]:
        raise UsageError(f"resume: the corpus differs from the one {out} was trained on "
                         f"(sha256 {saved.get('corpus', {}).get('sha256')} vs {fingerprint['sha256']})")


def _problems(results: dict) -> list[str]:
    """What a results dict lacks of what resume, the tables and the report read."""
    out = []
    cfg = results.get("config")
    if not isinstance(cfg, dict):
        out.append("no config")
    else:
        out += [f"config has no {k}" for k in ("train_length", "steps", "batch_size", "eval_lengths", "methods")
                if k not in cfg]
        out += [f"config {k} is {cfg[k]!r}, not an integer" for k in INTEGERS
                if k in cfg and cfg[k] is not None and not _count(cfg[k])]
        lengths = cfg.get("eval_lengths")
        if "eval_lengths" in cfg and not (isinstance(lengths, list) and all(_positive_int(n) for n in lengths)):
            out.append(f"config eval_lengths is {lengths!r}, not a list of positive integers")
    methods = results.get("methods")
    if not isinstance(methods, dict):
        return out + ["no methods"]
    metric = metric_of(results)
    for m, e in methods.items():
        if not isinstance(e, dict) or not isinstance(e.get("eval"), list) or not isinstance(e.get("train"), dict):
            out.append(f"method {m!r} has no train record or eval list")
        elif not all(isinstance(r, dict) and {"length", metric, "status"} <= set(r) for r in e["eval"]):
            out.append(f"method {m!r} has an eval row without length, {metric} or status")
        elif not all(_positive_int(r["length"]) and (r[metric] is None or _number(r[metric])) and isinstance(r["status"], str)
                     for r in e["eval"]):
            out.append(f"method {m!r} has an eval row whose length, {metric} or status has the wrong type")
    return out


# Config fields the tables, figures and report compute with: integers when present.
INTEGERS = ("train_length", "steps", "batch_size", "dim", "depth", "num_heads", "valid_bytes", "recall_sequences",
            "seeds", "sliding", "finetune_steps", "finetune_length")


def _positive_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def metric_of(results: dict) -> str:
    """The number a study's rows report: 'perplexity' (task lm) or 'accuracy' (task recall)."""
    return "accuracy" if (results.get("config") or {}).get("task") == "recall" else "perplexity"


def shown(entry: dict) -> list[dict]:
    """The evaluation rows to show for a row: the mean over seeds once two are done, else the
    first seed's."""
    across = entry.get("across_seeds")
    return across["eval"] if across else entry.get("eval", [])


def shown_train(entry: dict) -> dict:
    across = entry.get("across_seeds")
    return across["train"] if across else entry.get("train", {})


def run_status(results: dict, out: str | Path) -> str:
    """The status to show for a study: 'done', 'partial', 'running (pid N ...)', or 'interrupted'
    for a run that says running while no live process holds its directory's lock."""
    status = results.get("status", "?")
    if status != "running":
        return status
    holder = lock_holder(out)
    if holder is None:
        return "interrupted (resume with --resume)"
    return f"running (pid {holder.get('pid', '?')}, started {holder.get('started', '?')})"


def results_csv(results: dict) -> str:
    """One line per row and length (recall: per row, length and distance class), with intervals;
    seed columns filled when the row has several seeds."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    recall = metric_of(results) == "accuracy"
    head = ["method", "train_length", "eval_length"]
    head += (["distance", "distance_min", "distance_max", "accuracy", "acc_low", "acc_high", "queries"] if recall else
             ["perplexity", "ppl_low", "ppl_high", "bits_per_byte", "loss", "tokens"])
    head += ["status", "seeds", "seed_sd", "seed_min", "seed_max", "train_time_s", "train_tokens_per_s", "parameters"]
    w.writerow(head)
    key = "accuracy" if recall else "perplexity"
    for method, e in results["methods"].items():
        t = shown_train(e)
        tail = [t.get("time_s", ""), t.get("tokens_per_s", ""), e.get("parameters", "")]
        for row in shown(e):
            seeds = [row.get("seeds", 1), row.get("seed_sd", ""), row.get("seed_min", ""), row.get("seed_max", "")]
            base = [method, results["config"]["train_length"], row["length"]]
            if not recall:
                w.writerow([*base, row["perplexity"], row.get("ppl_low", ""), row.get("ppl_high", ""),
                            row["bits_per_byte"], row["loss"], row["tokens"], row["status"], *seeds, *tail])
                continue
            for cls, d in (row.get("distances") or {"": {}}).items():
                sd = [row.get("seeds", 1), *(d.get(f"seed_{k}", "") for k in ("sd", "min", "max"))]
                w.writerow([*base, cls, d.get("distance_min", ""), d.get("distance_max", ""), d.get(key),
                            d.get("acc_low", ""), d.get("acc_high", ""), d.get("queries", ""), row["status"], *sd,
                            *tail])
    return buf.getvalue()


def seconds(t: float) -> str:
    """Three significant digits (0.0312, 5.36, 45.3), whole seconds from 100 on."""
    return f"{t:.0f}" if t >= 100 else f"{t:.3g}"


def _cell(r: dict, key: str, low: str, high: str, fmt: str, intervals: bool) -> str:
    if not intervals or r.get(low) is None:
        return format(r[key], fmt)
    return f"{format(r[key], fmt)} [{format(r[low], fmt)}, {format(r[high], fmt)}]"


def markdown_table(results: dict, key: str = "perplexity", intervals: bool = False) -> str:
    """Rows x evaluation lengths (a bounded method past its table shows 'n/a (> N)'); recall
    studies show the far-distance accuracy. ``intervals``: the 95% bootstrap interval in brackets
    after each number and, with several seeds, the spread between seeds (min-max); without, plain
    numbers (results.md, a table other tools read)."""
    recall = metric_of(results) == "accuracy"
    found = {r["length"] for e in results["methods"].values() for r in shown(e)}
    if any(e.get("status") == "diverged" for e in results["methods"].values()):
        found |= set(results["config"].get("eval_lengths", []))  # its cells say so
    lengths = sorted(found)
    train_len = results["config"]["train_length"]
    head = ["method", *(f"{n}{'*' if n == train_len else ''}" for n in lengths), "train s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, e in results["methods"].items():
        by = {r["length"]: r for r in shown(e)}
        cells = []
        for n in lengths:
            r = by.get(n)
            if r is None and e.get("status") == "diverged":
                step = (e.get("train") or {}).get("diverged_at_step")
                cells.append("diverged" + (f" (step {step})" if step else ""))
            elif r is None:
                cells.append("")
            elif r.get("accuracy" if recall else key) is None:
                cells.append(f"n/a (> {e['model'].get('max_positions') or train_len})")
            elif recall:
                far = r["distances"]["far"]
                cells.append(_cell(far, "accuracy", "acc_low", "acc_high", ".2f", intervals)
                             + (_spread(far, ".2f") if intervals else ""))
            else:
                low, high = ("ppl_low", "ppl_high") if key == "perplexity" else ("", "")
                cells.append(_cell(r, key, low, high, ".3f", intervals) + (_spread(r, ".2f") if intervals else ""))
        t = shown_train(e).get("time_s")
        lines.append("| " + " | ".join([method, *cells, "-" if t is None else seconds(t)]) + " |")
    return "\n".join(lines)


def _spread(r: dict, fmt: str) -> str:
    if r.get("seed_min") is None:
        return ""
    return f" (seeds {format(r['seed_min'], fmt)}-{format(r['seed_max'], fmt)})"


def write_outputs(results: dict, out: Path, table: bool = False) -> None:
    """results.csv and extrapolation.png (and results.md when ``table``) from results.json's
    content: the methods finished so far."""

    write_text(out / "results.csv", results_csv(results))
    figure = figures.recall_figure if metric_of(results) == "accuracy" else figures.extrapolation_figure
    figures.save(figure(results), out / "extrapolation.png")
    if table:
        write_text(out / "results.md", markdown_table(results, intervals=True) + "\n")
