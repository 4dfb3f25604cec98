"""``posenc report RUN_DIR``: one self-contained HTML page for a study (figures inline as base64
PNG, tables, config, corpus fingerprint, versions); no network, no external files.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
from pathlib import Path

from .errors import UsageError
from .files import check_writable, write_text
from .study import load_results, run_status

GENERATOR = '<meta name="generator" content="posenc report">'  # how a page we may overwrite is known

CSS = """
body { font-family: system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
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


def _img(fig) -> str:
    from . import plots

    data = base64.b64encode(plots.png_bytes(fig)).decode("ascii")
    return f'<img alt="figure" src="data:image/png;base64,{data}">'


def _table(head: list[str], rows: list[list[str]]) -> str:
    e = html.escape
    out = ["<table>", "<tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>"]
    for row in rows:
        cells = "".join(f'<td class="na">{e(c)}</td>' if c.startswith(("n/a", "not run")) else f"<td>{e(c)}</td>" for c in row)
        out.append(f"<tr>{cells}</tr>")
    out.append("</table>")
    return "\n".join(out)


def _metric_table(results: dict, key: str, fmt: str, relative: bool = False) -> str:
    """Methods x lengths of ``key``; ``relative``: divided by the method's value at the train length."""
    lengths = sorted({r["length"] for e in results["methods"].values() for r in e.get("eval", [])})
    train_len = results["config"]["train_length"]
    rows = []
    for method, entry in results["methods"].items():
        by = {r["length"]: r for r in entry.get("eval", [])}
        base = (by.get(train_len) or {}).get(key) if relative else 1.0
        cells = [method]
        for n in lengths:
            r = by.get(n)
            if r is None or base is None:
                cells.append("not run")
            elif r.get(key) is None:
                cells.append(f"n/a: {r.get('status', '')}")
            else:
                cells.append(format(r[key] / base, fmt))
        rows.append(cells)
    head = ["method"] + [f"{n} (train)" if n == train_len else str(n) for n in lengths]
    return _table(head, rows)


def _kv(d: dict) -> str:
    return _table(["key", "value"], [[str(k), json.dumps(v) if not isinstance(v, str) else v] for k, v in d.items()])


def render(results: dict, title: str, status: str | None = None) -> str:
    """The report page for a results dict, as an HTML string (``status``: shown instead of the
    results' own, e.g. 'interrupted' for a run whose process is gone)."""
    from . import plots

    e = html.escape
    cfg = results["config"]
    train_rows = []
    for method, entry in results["methods"].items():
        t = entry.get("train", {})
        train_rows.append([
            method, entry.get("status", ""), f"{entry.get('parameters', 0):,}", str(t.get("steps", "")),
            f"{t.get('time_s', 0):.1f}", f"{t.get('tokens_per_s', 0):,.0f}", f"{t.get('final_loss', float('nan')):.4f}",
        ])
    valid = results.get("corpus", {}).get("valid_bytes_used")
    mode = f"sliding windows, stride {cfg['sliding']}" if cfg.get("sliding") else "non-overlapping windows"
    parts = [
        "<!doctype html>", '<html lang="en"><head><meta charset="utf-8">', GENERATOR,
        f"<title>{e(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{e(title)}</h1>",
        f'<p class="note">Status: {e(status or results.get("status", "?"))}. Byte-level language models trained at length '
        f"{cfg['train_length']} for {cfg['steps']} steps of {cfg['batch_size']} sequences, then scored on the same "
        f"{valid} validation bytes at every evaluation length ({e(mode)}). Train short, test long: Press, Smith &amp; "
        "Lewis 2021, arXiv:2108.12409. Perplexity is per byte; a method that extrapolates stays flat past the "
        "training length.</p>",
        "<h2>Extrapolation</h2>", _img(plots.extrapolation_figure(results)),
        "<h2>Perplexity</h2>", _metric_table(results, "perplexity", ".3f"),
        "<h2>Perplexity relative to the training length</h2>",
        '<p class="note">Perplexity at each length divided by the same method\'s perplexity at the training '
        "length: 1.00 is perfect extrapolation.</p>",
        _metric_table(results, "perplexity", ".2f", relative=True),
        "<h2>Bits per byte</h2>", _metric_table(results, "bits_per_byte", ".4f"),
        "<h2>Training</h2>", _img(plots.training_figure(results)),
        _table(["method", "status", "parameters", "steps", "time (s)", "tokens/s", "final loss"], train_rows),
        "<h2>Configuration</h2>", _kv(cfg),
        "<h2>Corpus</h2>", _kv(results.get("corpus", {})),
        "<h2>Versions</h2>", _kv(results.get("versions", {})),
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def add_report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a study's --out directory (holding results.json)")
    p.add_argument("--out", default=None, help="HTML file to write (default RUN_DIR/report.html)")


def run_report(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not (run_dir / "results.json").is_file():
        raise UsageError(f"run_dir {str(run_dir)!r} holds no results.json (expected the out directory of a study)")
    out = Path(args.out) if args.out else run_dir / "report.html"
    head = out.read_bytes()[:1024] if out.is_file() else b""
    if out.is_file() and GENERATOR.encode() not in head and b"<title>posenc study: " not in head:  # (older pages)
        raise UsageError(f"out: {out} exists and is not a posenc report; choose another name "
                         "(posenc does not overwrite other files)")
    check_writable(out, "out")  # before any rendering
    results = load_results(run_dir)
    write_text(out, render(results, f"posenc study: {run_dir.name}", run_status(results, run_dir)))
    print(f"wrote {out}")
    return 0
