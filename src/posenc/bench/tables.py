"""The tables of a run: markdown (the paper-style table, and posenc against compared libraries), CSV, JSON.

The markdown table follows the speed/memory table of the ALiBi paper (Press et al. 2021, "Train
Short, Test Long", Table 1: training speed, inference speed and memory per method), each figure
also given as a ratio to NoPE: the median over rounds of the ratio to the NoPE of the same round,
with the spread (min-max) over rounds in brackets. The CSV has one row per cell with every round's
figures; the JSON has the meta data (machine, options, command), the cells and every job's record.
"""

from __future__ import annotations

import csv
import io

from .harness import Results
from .job import POSENC
from .levels import LEVELS
from .libraries import library_of
from .machine import machine_line


def ratio_cell(row: dict, key: str) -> str:
    """``1.14x (1.08-1.21)``: median ratio over rounds and its min-max; no spread from one round."""
    mid, lo, hi = row.get(key), row.get(f"{key}_lo"), row.get(f"{key}_hi")
    if mid is None:
        return "-"
    measured = sum(v is not None for v in row.get(f"{key}_rounds", [mid]))
    return f"{mid:.2f}x" if measured < 2 else f"{mid:.2f}x ({lo:.2f}-{hi:.2f})"


def _status(row: dict | None) -> str | None:
    """None for a measured cell; what to print instead otherwise."""
    if row is None:
        return ""
    if row.get("status") == "ok":
        return None
    return {"n/a": "n/a", "refused": "refused"}.get(str(row.get("status")), "failed")


def _partial(row: dict) -> str:
    return f" [{row['rounds_ok']}/{row['rounds']}]" if row.get("rounds_ok", 0) < row.get("rounds", 0) else ""


def _time_cells(row: dict | None) -> list[str]:
    s = _status(row)
    if s is not None or row is None:  # (_status is None only for a measured row)
        return [s or "", "", ""]
    return [f"{row['median_s']:.4g}{_partial(row)}", f"{row['tokens_per_s']:,.0f}", ratio_cell(row, "median_s_vs_nope")]


def _mem_cells(row: dict | None) -> list[str]:
    s = _status(row)
    if s is not None or row is None:  # (_status is None only for a measured row)
        return [s or "", ""]
    ratio = "-" if row.get("peak_mb_vs_nope") is None else f"{row['peak_mb_vs_nope']:.2f}x"
    if row.get("increase_mb_vs_nope") is not None:
        ratio += f" ({row['increase_mb_vs_nope']:.2f}x)"
    return [f"{row['peak_mb']:.0f} (+{row['increase_mb']:.0f})", ratio]


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _short(impl: str) -> str:
    return impl.replace("x-transformers", "x-t")


HOW_TO_READ = (
    "Ratios to NoPE: the median over rounds of (this job's time / NoPE's time in the same round, mode and "
    "length), with the min-max over rounds in brackets. `nope (control)` is NoPE measured again in every round "
    "as if it were another method: it should read 1.00x within its spread, and its spread is this table's noise "
    "floor (a difference smaller than that is not shown by these figures). Memory: peak and (increase over the "
    "worker's baseline), medians over rounds. [k/R]: only k of R rounds measured."
)


def markdown_table(results: Results) -> str:
    """The paper-style table: per method and length, train and inference speed and memory."""
    cells, meta = results.cells, results.meta
    if not cells:
        return "(no results)\n"
    level = LEVELS[cells[0]["level"]]
    modes = [m for m in level.modes if any(r["mode"] == m for r in cells)]
    index = {(r["label"], r["impl"], r["length"], r["mode"]): r for r in cells}
    rows = list(dict.fromkeys((r["length"], r["label"], r["impl"]) for r in cells))
    mem = "MB allocated" if cells[0].get("device") == "cuda" else "peak RSS MB"
    compared = any(r["impl"] != POSENC for r in cells)
    header = ["method", "impl", "N"] if compared else ["method", "N"]
    keys = len(header)
    for m in modes:
        header += [f"{m} {level.unit(m)}", f"{m} tok/s", f"{m} time vs NoPE"]
    for m in modes:
        header += [f"{m} {mem} (+over base)", f"{m} mem vs NoPE: peak (increase)"]
    lines = []
    if meta.get("title"):
        lines += [f"**{meta['title']}**", ""]
    if meta.get("machine"):
        threads = next((r.get("threads_used") for r in cells if r.get("threads_used")), None)
        lines += [machine_line(meta["machine"], threads), ""]
    lines += [HOW_TO_READ, "", _row(header), _row(["---"] * keys + ["---:"] * (len(header) - keys))]
    for n, name, impl in rows:
        out = [name, _short(impl), str(n)] if compared else [name, str(n)]
        for m in modes:
            out += _time_cells(index.get((name, impl, n, m)))
        for m in modes:
            out += _mem_cells(index.get((name, impl, n, m)))
        lines.append(_row(out))
    lines.append("")
    lines += _notes(cells)
    if compared:
        lines.append(compare_table(cells))
    return "\n".join(lines)


def _notes(cells: list[dict]) -> list[str]:
    """The control's verdict, the backends each method ran, and what was not measured."""
    lines = []
    for r in cells:
        lo, hi = r.get("median_s_vs_nope_lo"), r.get("median_s_vs_nope_hi")
        measured = sum(v is not None for v in r.get("median_s_vs_nope_rounds", []))
        if r["control"] and measured >= 2 and lo is not None and hi is not None and not lo <= 1.0 <= hi:
            lines.append(f"Warning: the control reads {ratio_cell(r, 'median_s_vs_nope')} at N={r['length']} "
                         f"{r['mode']}: 1.00 is outside its spread, so differences of that size are noise here "
                         "(a quieter machine or more rounds).")
    used: dict[str, dict[str, None]] = {}  # method -> "mode: backend" seen, in order
    for r in cells:
        if r["impl"] == POSENC and r.get("status") == "ok" and not r["control"]:
            used.setdefault(r["label"], {})[f"{r['mode']} {r['backend_used']}"] = None
    if used:
        lines.append("posenc backends: " + "; ".join(f"{m} ({', '.join(v)})" for m, v in used.items()))
    problems: dict[tuple, list[str]] = {}  # (method, impl, status, error) -> where it happened
    for r in cells:
        if r.get("error") and r.get("status") != "n/a":
            key = (r["label"], r["impl"], r["status"], r["error"][:300])
            part = f", {r['rounds_ok']}/{r['rounds']} rounds measured" if r.get("rounds_ok") else ""
            problems.setdefault(key, []).append(f"N={r['length']} {r['mode']}{part}")
    if problems:
        lines += ["", "Not measured:"]
        for (name, impl, status, error), where in problems.items():
            lines.append(f"- {name} {impl} ({'; '.join(where)}): {status}: {error}")
    return lines + ([""] if lines else [])


def compare_table(cells: list[dict]) -> str:
    """posenc against each compared implementation, per method, length and mode: times and ratios."""
    index = {(r["label"], r["impl"], r["length"], r["mode"]): r for r in cells}
    others = list(dict.fromkeys(r["impl"] for r in cells if r["impl"] != POSENC))
    keys = list(dict.fromkeys((r["length"], r["mode"], r["label"]) for r in cells if not r["control"]))
    header = ["method", "N", "mode", "posenc s", *(f"{_short(i)} s" for i in others),
              *(f"{_short(i)} / posenc" for i in others), "posenc +MB", *(f"{_short(i)} +MB" for i in others)]
    lines = [
        "**posenc vs " + ", ".join(dict.fromkeys(library_of(i).NAME for i in others))
        + "** (time ratios > 1: posenc is faster; median over rounds of the "
        "ratio within a round (min-max); +MB: memory over each worker's baseline)",
        "", _row(header), _row(["---"] * 3 + ["---:"] * (len(header) - 3)),
    ]

    def t(r: dict | None) -> str:
        return f"{r['median_s']:.4g}" if r and r.get("status") == "ok" else (_status(r) or "")

    def mb(r: dict | None) -> str:
        return f"{r['increase_mb']:.0f}" if r and r.get("status") == "ok" else (_status(r) or "")

    for n, mode, name in keys:
        p = index.get((name, POSENC, n, mode))
        rs = [index.get((name, impl, n, mode)) for impl in others]
        ratios = [ratio_cell(r, "median_s_vs_posenc") if r else "-" for r in rs]
        lines.append(_row([name, str(n), mode, t(p), *(t(r) for r in rs), *ratios, mb(p), *(mb(r) for r in rs)]))
    lines.append("")
    return "\n".join(lines)


CSV_FIELDS = [
    "level", "mode", "impl", "label", "method", "control", "length", "status", "rounds", "rounds_ok",
    "median_s", "min_s", "tokens_per_s", "median_s_vs_nope", "median_s_vs_nope_lo", "median_s_vs_nope_hi",
    "tokens_per_s_vs_nope", "baseline_mb", "peak_mb", "increase_mb", "peak_mb_vs_nope", "peak_mb_vs_nope_lo",
    "peak_mb_vs_nope_hi", "increase_mb_vs_nope", "median_s_vs_posenc", "median_s_vs_posenc_lo",
    "median_s_vs_posenc_hi", "backend", "backend_used", "round_median_s", "median_s_vs_nope_rounds",
    "round_peak_mb", "peak_mb_vs_nope_rounds", "round_increase_mb", "increase_mb_vs_nope_rounds",
    "median_s_vs_posenc_rounds", "dtype", "device", "threads_used", "dim", "heads", "depth", "batch", "vocab",
    "repeats", "warmup", "cpu_model", "torch", "error",
]


def csv_text(results: Results) -> str:
    """One row per cell; per-round figures as space-separated lists ("-": that round not measured)."""
    machine = results.meta.get("machine", {})
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for r in results.cells:
        row = dict(r, cpu_model=machine.get("cpu_model"), torch=machine.get("torch"))
        for key, value in row.items():
            if isinstance(value, list):
                row[key] = " ".join("-" if v is None else f"{v:.6g}" for v in value)
        writer.writerow(row)
    return buffer.getvalue()


def json_object(results: Results) -> dict:
    return {"meta": results.meta, "cells": results.cells, "jobs": results.jobs}
