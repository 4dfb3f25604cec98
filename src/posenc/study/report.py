"""``posenc report RUN_DIR [RUN_B]``: one self-contained HTML page for a study, or two side by side
(figures inline as base64 PNG, tables, config, corpus fingerprint, versions); no network, no
external files.

One run: a summary per row (perplexity at the training length and at the longest length with 95%
intervals, or recall accuracy in distribution and far away, training tokens/s), the figures
(extrapolation with intervals or recall by distance, training curves of every row), the full
tables, the position parameters used untrained, and how it was run. Two runs: see
:mod:`posenc.study.compare`.

One file is the page: its sections in the order they render, and the few HTML helpers they share;
split, a reader would have to assemble one page from two files.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UsageError
from ..files import check_writable, write_text
from . import compare, figures
from .results import load_results, markdown_table, metric_of, run_status, shown, shown_train

if TYPE_CHECKING:
    from matplotlib.figure import Figure

GENERATOR = '<meta name="generator" content="posenc report">'  # how a page we may overwrite is known

CSS = """
body { font-family: system-ui, sans-serif; max-width: 64rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
table { border-collapse: collapse; margin: 0.5rem 0 1.5rem; font-size: 0.9rem; }
th, td { border: 1px solid #ccc; padding: 0.25rem 0.6rem; text-align: right; }
th:first-child, td:first-child { text-align: left; }
th { background: #f3f3f3; }
td.na { color: #999; }
img { max-width: 100%; }
code, pre { background: #f6f6f6; font-size: 0.85rem; }
pre { padding: 0.6rem; overflow-x: auto; }
.note { color: #555; font-size: 0.9rem; }
"""


def _img(fig: Figure) -> str:

    data = base64.b64encode(figures.png_bytes(fig)).decode("ascii")
    return f'<img alt="figure" src="data:image/png;base64,{data}">'


def _table(head: list[str], rows: list[list[str]]) -> str:
    e = html.escape
    out = ["<table>", "<tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>"]
    for row in rows:
        cells = "".join(f'<td class="na">{e(c)}</td>' if c.startswith(("n/a", "not run")) else f"<td>{e(c)}</td>" for c in row)
        out.append(f"<tr>{cells}</tr>")
    out.append("</table>")
    return "\n".join(out)


def _interval(r: dict, key: str, low: str, high: str, fmt: str) -> str:
    """'4.852 [4.71, 5.00]' (and the seeds' min-max when there are several)."""
    text = format(r[key], fmt)
    if r.get(low) is not None:
        text += f" [{format(r[low], fmt)}, {format(r[high], fmt)}]"
    if r.get("seed_min") is not None:
        text += f" seeds {format(r['seed_min'], fmt)}-{format(r['seed_max'], fmt)}"
    return text


def _metric_table(results: dict, key: str, fmt: str, relative: bool = False, intervals: bool = False) -> str:
    """Rows x lengths of ``key``; ``relative``: divided by the row's value at the train length;
    ``intervals``: with the 95% bootstrap interval (and the seeds' spread)."""
    lengths = sorted({r["length"] for e in results["methods"].values() for r in shown(e)})
    train_len = results["config"]["train_length"]
    rows = []
    for method, entry in results["methods"].items():
        by = {r["length"]: r for r in shown(entry)}
        base = (by.get(train_len) or {}).get(key) if relative else 1.0
        cells = [method]
        for n in lengths:
            r = by.get(n)
            if r is None or base is None:
                cells.append("not run")
            elif r.get(key) is None:
                cells.append(f"n/a: {r.get('status', '')}")
            elif intervals:
                cells.append(_interval(r, key, "ppl_low", "ppl_high", fmt))
            else:
                cells.append(format(r[key] / base, fmt))
        rows.append(cells)
    head = ["method"] + [f"{n} (train)" if n == train_len else str(n) for n in lengths]
    return _table(head, rows)


def _recall_table(results: dict, cls: str) -> str:
    lengths = sorted({r["length"] for e in results["methods"].values() for r in shown(e)})
    train_len = results["config"]["train_length"]
    rows = []
    for method, entry in results["methods"].items():
        by = {r["length"]: r for r in shown(entry)}
        cells = [method]
        for n in lengths:
            r = by.get(n)
            if r is None:
                cells.append("not run")
            elif r.get("accuracy") is None:
                cells.append(f"n/a: {r.get('status', '')}")
            else:
                d = r["distances"][cls]
                cells.append(_interval(d, "accuracy", "acc_low", "acc_high", ".2f") +
                             f" (d {d['distance_min']}-{d['distance_max']})")
        rows.append(cells)
    head = ["method"] + [f"{n} (train)" if n == train_len else str(n) for n in lengths]
    return _table(head, rows)


def summary_rows(results: dict) -> dict[str, dict[str, str]]:
    """Per row: the summary's cells (ppl at 1x and at the longest length, or recall in
    distribution and far at the longest length; training tokens/s)."""
    train_len = results["config"]["train_length"]
    recall = metric_of(results) == "accuracy"
    out = {}
    for method, entry in results["methods"].items():
        by = {r["length"]: r for r in shown(entry)}
        longest = max(by) if by else None
        cells = {}
        if recall:
            inside, far = by.get(train_len), by.get(longest)
            cells["recall at 1x (all distances)"] = (_interval(inside, "accuracy", "acc_low", "acc_high", ".2f")
                                                     if inside and inside.get("accuracy") is not None else "n/a")
            cells[f"recall far at {longest}"] = (_interval(far["distances"]["far"], "accuracy", "acc_low", "acc_high", ".2f")
                                                 if far and far.get("accuracy") is not None else "n/a")
        else:
            for label, n in (("ppl at 1x", train_len), (f"ppl at {longest}", longest)):
                r = by.get(n)
                cells[label] = _interval(r, "perplexity", "ppl_low", "ppl_high", ".3f") if r and r.get("perplexity") is not None else "n/a"
        t = shown_train(entry)
        if entry.get("status") == "diverged":
            cells["train tokens/s"] = "n/a (diverged)"
        else:
            cells["train tokens/s"] = f"{t['tokens_per_s']:,.0f}" if t.get("tokens_per_s") else "n/a (evaluation only)"
        out[method] = cells
    return out


def _summary(results: dict, other: dict | None = None) -> str:
    """The summary table of one run, or of an LM run and a recall run joined by row."""
    first = summary_rows(results)
    second = summary_rows(other) if other is not None else {}
    methods = list(dict.fromkeys([*first, *second]))
    head = ["method", *next(iter(first.values()), {}).keys()]
    extra = [k for k in next(iter(second.values()), {}) if k != "train tokens/s"]
    head += extra
    rows = []
    for m in methods:
        a, b = first.get(m, {}), second.get(m, {})
        rows.append([m, *(a.get(k, "not run") for k in head[1 : len(head) - len(extra)]),
                     *(b.get(k, "not run") for k in extra)])
    return _table(head, rows)


def _untrained(results: dict) -> str:
    rows = []
    for method, entry in results["methods"].items():
        for r in entry.get("eval", []):
            for u in r.get("untrained") or []:
                rows.append([method, str(r["length"]), u["parameter"], u["rows"], f"{u['count']} of {u['of']}"])
    checked = any(r.get("untrained") is not None for e in results["methods"].values() for r in e.get("eval", []))
    text = ('<p class="note">An element of an encoding\'s parameter that an evaluation length uses (a non-zero '
            "gradient from one pass at that length) but that training never updated (it equals its initial value) "
            "decides the output with a random number: the set-up, not the method. Rows are the first index: a T5 "
            "bucket, a learned position, a Shaw clipped distance.</p>")
    if rows:
        return text + _table(["method", "length", "parameter", "rows used untrained", "count"], rows)
    return text + ('<p>None: every position parameter used at an evaluation length was trained.</p>' if checked
                   else '<p>No row has position parameters to check.</p>')


def _kv(d: dict) -> str:
    return _table(["key", "value"], [[str(k), json.dumps(v) if not isinstance(v, str) else v] for k, v in d.items()])


def _options(entry: dict) -> str:
    """The encoding options a row trained with (the fair-table rule's included), and how it varies."""
    row = entry.get("row") or {}
    text = ", ".join(f"{k}={v}" for k, v in (row.get("options") or {}).items())
    if row.get("schedule"):
        text = f"layers {row['schedule']}"
    if row.get("positions_dropped_after"):
        text += f"{'; ' if text else ''}positions dropped for the last {row['positions_dropped_after']:g} of the steps"
    if row.get("random_positions"):
        text += f"{'; ' if text else ''}random positions from [0, {row['random_positions']})"
    if row.get("finetune"):
        text += f"{'; ' if text else ''}fine-tuned {row['finetune']['steps']} steps at {row['finetune']['length']}"
    return text or "-"


def _train_table(results: dict) -> str:
    rows = []
    for method, entry in results["methods"].items():
        t = shown_train(entry)
        if entry.get("status") == "diverged":
            step = t.get("diverged_at_step")
            rows.append([method, "diverged" + (f" at step {step}" if step else ""), "", _options(entry),
                         str(t.get("reason", "")), "", "", ""])
            continue
        if not t:
            rows.append([method, entry.get("status", ""), f"{entry.get('parameters', 0):,}", _options(entry),
                         "n/a (evaluation only)", "", "", ""])
            continue
        rows.append([
            method, entry.get("status", ""), f"{entry.get('parameters', 0):,}", _options(entry), str(t.get("steps", "")),
            f"{t.get('time_s', 0):.1f}", f"{t.get('tokens_per_s', 0):,.0f}", f"{t.get('final_loss', float('nan')):.4f}",
        ])
    return _table(["method", "status", "parameters", "options", "steps", "time (s)", "tokens/s", "final loss"], rows)


def _separations(results: dict, h: str, against: list[str] | None = None) -> list[str]:
    """The rows separated from each other (:mod:`posenc.study.compare`) at the training length and
    the longest length, as matrices, and row by row against each of ``against``."""
    lengths = sorted({r["length"] for e in results["methods"].values() for r in shown(e)})
    if not lengths:
        return []
    what = "far-distance accuracy" if metric_of(results) == "accuracy" else "perplexity"
    parts = [f"<{h}>Differences that hold across seeds</{h}>",
             f'<p class="note">A cell says how the row\'s {what} compares with the column\'s: <b>below</b> or '
             "<b>above</b> only where both the 95% intervals over the windows and the ranges of the seeds' numbers "
             "are apart (every seed on one side); <b>overlaps</b> where either overlaps; <b>one seed</b> where the "
             "rule needs a second seed.</p>"]
    train_len = results["config"]["train_length"]
    for n in dict.fromkeys([train_len, lengths[-1]]):
        m = compare.matrix(results, n)
        names = list(m)
        rows = [[a, *("-" if a == b else m[a][b] for b in names)] for a in names]
        parts += [f"<p>At length {n}{' (train)' if n == train_len else ''}:</p>", _table(["row \\ column", *names], rows)]
    for other in against or []:
        marks = compare.versus(results, other)
        head = ["method", *(f"{n} (train)" if n == train_len else str(n) for n in lengths)]
        rows = [[m, *(by.get(n, "n/a") for n in lengths)] for m, by in marks.items() if m != other]
        parts += [f"<p>Each row against {html.escape(other)}:</p>", _table(head, rows)]
    return parts


def sections(results: dict, level: int = 2, against: list[str] | None = None) -> list[str]:
    """The body of one run's report (headings at ``level``)."""

    h = f"h{level}"
    recall = metric_of(results) == "accuracy"
    parts = [f"<{h}>Summary</{h}>", _summary(results)]
    if recall:
        parts += [f"<{h}>Recall by distance</{h}>", _img(figures.recall_figure(results))]
        for cls in ("near", "middle", "far"):
            parts += [f"<{h}>Recall accuracy, {cls}</{h}>", _recall_table(results, cls)]
    else:
        parts += [
            f"<{h}>Extrapolation</{h}>", _img(figures.extrapolation_figure(results)),
            f"<{h}>Perplexity</{h}>", _metric_table(results, "perplexity", ".3f"),
            f"<{h}>Perplexity with 95% intervals</{h}>",
            '<p class="note">Brackets: the 95% bootstrap interval over the scored windows (the text\'s sampling '
            "noise, no retraining); with several seeds, the mean over seeds and the seeds' min-max after it.</p>",
            _metric_table(results, "perplexity", ".3f", intervals=True),
            f"<{h}>Perplexity relative to the training length</{h}>",
            '<p class="note">Perplexity at each length divided by the same method\'s perplexity at the training '
            "length: 1.00 is perfect extrapolation.</p>",
            _metric_table(results, "perplexity", ".2f", relative=True),
            f"<{h}>Bits per byte</{h}>", _metric_table(results, "bits_per_byte", ".4f"),
        ]
    parts += _separations(results, h, against)
    parts += [f"<{h}>Position parameters used but never trained</{h}>", _untrained(results),
              f"<{h}>Training</{h}>", _img(figures.training_figure(results)), _train_table(results),
              f"<{h}>Configuration</{h}>", _kv(results["config"]),
              f"<{h}>Corpus</{h}>", _kv(results.get("corpus", {})),
              f"<{h}>Versions</{h}>", _kv(results.get("versions", {}))]
    return parts


def _intro(results: dict, status: str | None) -> str:
    """The paragraph under the title. Every value from results.json is escaped (as in every table):
    a shared run directory must not be able to put markup into the page."""
    cfg = results["config"]

    def e(value: object) -> str:
        return html.escape(str(value))

    if metric_of(results) == "accuracy":
        return (f'<p class="note">Status: {e(status or results.get("status", "?"))}. Associative recall: models trained '
                f"at length {e(cfg['train_length'])} for {e(cfg['steps'])} steps, then asked for the value of keys placed "
                f"near, mid-sequence and far from the query at every evaluation length ({e(cfg.get('recall_sequences'))} "
                "sequences per length and distance). A method that uses far context keeps its far accuracy past the "
                "training length; flat perplexity alone does not show this.</p>")
    valid = results.get("corpus", {}).get("valid_bytes_used")
    mode = f"sliding windows, stride {cfg['sliding']}" if cfg.get("sliding") else "non-overlapping windows"
    return (f'<p class="note">Status: {e(status or results.get("status", "?"))}. Byte-level language models trained at '
            f"length {e(cfg['train_length'])} for {e(cfg['steps'])} steps of {e(cfg['batch_size'])} sequences, then "
            f"scored on the same {e(valid)} validation bytes at every evaluation length ({e(mode)}). Train short, test "
            "long: Press, Smith &amp; Lewis 2021, arXiv:2108.12409. Perplexity is per byte; a method that extrapolates "
            "stays flat past the training length.</p>")


def _page(title: str, body: list[str]) -> str:
    e = html.escape
    parts = ["<!doctype html>", '<html lang="en"><head><meta charset="utf-8">', GENERATOR,
             f"<title>{e(title)}</title><style>{CSS}</style></head><body>", f"<h1>{e(title)}</h1>", *body,
             "</body></html>"]
    return "\n".join(parts) + "\n"


def render(results: dict, title: str, status: str | None = None, against: list[str] | None = None) -> str:
    """The report page for a results dict, as an HTML string (``status``: shown instead of the
    results' own, e.g. 'interrupted' for a run whose process is gone; ``against``: rows to set every
    row against, beside the all-pairs matrices)."""
    return _page(title, [_intro(results, status), *sections(results, against=against)])


def render_markdown(results: dict, against: list[str] | None = None) -> str:
    """The study's table in markdown (mean over seeds [95% interval] (the seeds' min-max), training
    seconds), then, per row of ``against``, every row's mark against it (:mod:`.compare`)."""
    parts = [markdown_table(results, intervals=True)]
    for other in against or []:
        parts += [f"Against {other} (below/above: every seed and the 95% intervals apart; see posenc.study.compare):",
                  compare.markdown_versus(results, other)]
    return "\n\n".join(parts) + "\n"


def render_two(a: dict, root_a: Path, b: dict, root_b: Path, names: tuple[str, str],
               status: tuple[str | None, str | None] = (None, None)) -> str:
    """Two runs on one page (see :mod:`posenc.study.compare`)."""
    e = html.escape
    body = []
    if metric_of(a) != metric_of(b):
        lm, rc = (a, b) if metric_of(b) == "accuracy" else (b, a)
        body += [f'<p class="note">{e(names[0])} and {e(names[1])}: a language-model study and a recall study; the '
                 "summary joins them by row: perplexity from the first, recall from the second.</p>",
                 "<h2>Summary: perplexity and recall</h2>", _summary(lm, rc)]
    else:
        differs = compare.check_pairable(a, b, *names)
        recall = metric_of(a) == "accuracy"
        what = "far-distance recall accuracy" if recall else "perplexity"
        only = sorted(set(a["methods"]) ^ set(b["methods"]))
        body.append(f'<p class="note">{e(what.capitalize())} of {e(names[0])} (A) and {e(names[1])} (B) on the same '
                    "windows; B - A with a paired 95% bootstrap interval (each resample draws the same windows for both "
                    "runs). An interval that excludes 0 is a difference the evaluation text resolves.</p>")
        body.append("<h2>What differs</h2>" + (_table(["config: A -> B"], [[d] for d in differs]) if differs
                                               else "<p>Nothing in the configuration (another seed or machine?).</p>"))
        if only:
            body.append(f'<p class="note">Rows in one run only (not compared): {e(", ".join(only))}.</p>')
        fmt = ".3f" if recall else ".3f"
        rows = []
        for d in compare.differences(a, root_a, b, root_b):
            if d["diff"] is None:
                rows.append([d["method"], str(d["length"]), "n/a", "n/a", "n/a"])
                continue
            diff = f"{d['diff']:+{fmt}}" + (f" [{d['low']:+{fmt}}, {d['high']:+{fmt}}]" if d["low"] is not None else "")
            rows.append([d["method"], str(d["length"]), format(d["a"], fmt), format(d["b"], fmt), diff])
        body += ["<h2>B - A</h2>", _table(["method", "length", "A", "B", "B - A [95%]"], rows)]
    for name, res, st in ((names[0], a, status[0]), (names[1], b, status[1])):
        body += [f"<h2>{e(name)}</h2>", _intro(res, st), *sections(res, level=3)]
    return _page(f"posenc study: {names[0]} vs {names[1]}", body)


def add_report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a study's --out directory (holding results.json)")
    p.add_argument("other", nargs="?", default=None,
                   help="a second study's directory: both side by side (differences with paired intervals)")
    p.add_argument("--out", default=None, help="HTML file to write (default RUN_DIR/report.html, or "
                                               "RUN_DIR/compare-OTHER.html for two runs)")
    p.add_argument("--versus", action="append", default=None, metavar="ROW",
                   help="also set every row against ROW (repeatable): below/above where the seeds and the "
                        "intervals both separate them, else overlaps")
    p.add_argument("--markdown", action="store_true",
                   help="print the study's table (and the --versus marks) as markdown to stdout instead of "
                        "writing HTML")


def _check_run(path: Path, what: str) -> None:
    if not (path / "results.json").is_file():
        raise UsageError(f"{what} {str(path)!r} holds no results.json (expected the out directory of a study)")


def _load(path: Path, what: str) -> dict:
    """The results in ``path`` (whose results.json :func:`_check_run` found)."""
    results = load_results(path)
    if results is None:
        raise UsageError(f"{what} {str(path)!r} holds no results.json (expected the out directory of a study)")
    return results


def run_report(args: argparse.Namespace) -> int:
    """``posenc report``: the study in ``run_dir`` (beside ``other``, if given) as an HTML page at ``out``.

    Raises:
        UsageError: ``out`` exists and is not a posenc report (it is never overwritten).
    """
    run_dir = Path(args.run_dir)
    _check_run(run_dir, "run_dir")
    other = Path(args.other) if getattr(args, "other", None) else None
    if other is not None:
        _check_run(other, "other")
    against = getattr(args, "versus", None) or []
    if getattr(args, "markdown", False):
        if other is not None or args.out:
            raise UsageError("markdown: prints one study's tables to stdout; give no second run and no --out "
                             "(redirect the output to a file instead)")
        results = _load(run_dir, "run_dir")
        for row in against:
            compare.check_row(results, row)
        print(render_markdown(results, against), end="")
        return 0
    if other is not None and against:
        raise UsageError("versus: marks rows within one study; for two studies the page shows B - A per row")
    default = run_dir / ("report.html" if other is None else f"compare-{other.resolve().name}.html")
    out = Path(args.out) if args.out else default
    head = out.read_bytes()[:1024] if out.is_file() else b""
    if out.is_file() and GENERATOR.encode() not in head and b"<title>posenc study: " not in head:  # (older pages)
        raise UsageError(f"out: {out} exists and is not a posenc report; choose another name "
                         "(posenc does not overwrite other files)")
    check_writable(out, "out")  # before any rendering
    results = _load(run_dir, "run_dir")
    for row in against:
        compare.check_row(results, row)
    if other is None:
        page = render(results, f"posenc study: {run_dir.name}", run_status(results, run_dir), against)
    else:
        second = _load(other, "other")
        page = render_two(results, run_dir, second, other, (run_dir.name, other.name),
                          (run_status(results, run_dir), run_status(second, other)))
    write_text(out, page)
    print(f"wrote {out}")
    return 0
