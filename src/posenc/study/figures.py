"""Figures of a study, drawn from its results dict: extrapolation (the paper's Figure 1 shape) with
95% intervals, recall accuracy by distance, and training loss. Built on ``matplotlib.figure.Figure``
directly, so no pyplot state and no display.

Colours: one per method, fixed, so every figure of every run reads the same; a row that varies a
method (``rope+yarn``, ``rope+drop``, ``t5:max_distance=128``) takes a shade of its method's colour,
and rows that only evaluate a trained model differently are dashed. A schedule row takes a shade of
its first layer's method's colour, fixed by its text.
"""

from __future__ import annotations

import io
import zlib
from pathlib import Path

from matplotlib.colors import to_hex, to_rgb
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from ..files import atomic_write
from .rows import parse

# One fixed colour per method, so every figure of every run reads the same.
COLORS = {
    "nope": "#7f7f7f", "sinusoidal": "#d62728", "learned": "#8c564b", "shaw": "#9467bd",
    "transformer_xl": "#e377c2", "t5": "#2ca02c", "rope": "#ff7f0e", "alibi": "#1f77b4",
    "xpos": "#bcbd22", "kerple": "#17becf", "sandwich": "#393b79", "fire": "#843c39", "cope": "#7b4173",
    "mrope": "#e6550d", "axial_rope": "#fd8d3c", "rope_mixed": "#a63603", "xdrope": "#d94801", "fope": "#f16913",  # oranges: rope's family
    "deberta": "#637939", "fox": "#e7ba52", "pope": "#756bb1", "dpb": "#6baed6",
    "inkling": "#8c6d31", "selective": "#ad494a",
    "hf": "#000000",  # not a method: a transformers model's own attention (hf_config studies)
}
# Shades of a method's colour for its variants: rope's scalings, drop and random positions form one
# family of oranges. Mixed with white (> 0) or black (< 0) by this much.
SHADES = {
    "linear": 0.45, "ntk": -0.35, "dynamic": 0.25, "yarn": -0.55, "llama3": 0.6, "longrope": -0.2,
    "drop": -0.7, "random": 0.75, "blockwise": -0.45, "ft": 0.15,
}
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "<", ">", "h", "*", "p")
EVAL_ONLY = ("linear", "ntk", "dynamic", "yarn", "llama3", "longrope", "blockwise")


def _mix(color: str, amount: float) -> str:
    rgb = to_rgb(color)
    target = (1.0, 1.0, 1.0) if amount > 0 else (0.0, 0.0, 0.0)
    a = abs(amount)
    r, g, b = (c + (t - c) * a for c, t in zip(rgb, target))
    return to_hex((r, g, b))


def color(row: str) -> str | None:
    """The colour of a row: its method's, shaded by its variants (and by its own options)."""
    if row in COLORS:
        return COLORS[row]
    if "[" in row:  # a schedule row: its first layer's colour, in a shade fixed by the schedule's text

        parsed = parse(row)
        c = COLORS.get(parsed.method)
        if c is None or parsed.schedule is None:
            return None
        shade = zlib.crc32(parsed.schedule.encode()) % 16  # (the same text, the same shade, in every run)
        c = _mix(c, (1 if shade % 2 else -1) * (0.12 + 0.08 * (shade // 2)))
        for v in parsed.train + ((parsed.eval,) if parsed.eval else ()) + (("ft",) if parsed.finetune else ()):
            c = _mix(c, SHADES.get(v, 0.3))
        return c
    head, *variants = row.split("+")
    method, _, options = head.partition(":")
    c = COLORS.get(method)
    if c is None:
        return None
    for v in variants:
        c = _mix(c, SHADES.get(v, 0.3))
    return _mix(c, -0.4) if options else c


def style(row: str) -> str:
    """Dashed for a row that only evaluates another row's model differently."""
    return "--" if any(v in EVAL_ONLY for v in row.split("+")[1:]) else "-"


def _shown(entry: dict) -> list[dict]:
    across = entry.get("across_seeds")
    return across["eval"] if across else entry.get("eval", [])


def extrapolation_figure(results: dict) -> Figure:
    """Perplexity vs evaluation length (log x), one line per method, the training length marked."""
    fig = Figure(figsize=(8.5, 4.8), layout="constrained")
    ax = fig.subplots()
    train_len = results["config"]["train_length"]
    values = []
    seeded = False
    n = len(results["methods"])
    for i, (method, entry) in enumerate(results["methods"].items()):
        shown = _shown(entry)
        rows = [r for r in shown if r.get("perplexity") is not None]
        if not rows:
            continue
        xs, ys = [r["length"] for r in rows], [r["perplexity"] for r in rows]
        values += ys
        label = method
        if any(r.get("perplexity") is None for r in shown):  # a bounded method: say where it stops
            label += f" (cannot run past {entry.get('model', {}).get('max_positions') or max(xs)})"
        c = color(method)
        # One point is drawn as a marker, not a line: its legend entry then shows a marker too.
        line, = ax.plot(xs, ys, marker="o", ms=4 if len(xs) > 1 else 7, ls=style(method) if len(xs) > 1 else "none",
                        label=label, color=c)
        drawn = line.get_color()  # the colour matplotlib chose when the method has none
        if all(r.get("ppl_low") is not None for r in rows):  # the 95% bootstrap interval, as bars
            dodge = 2 ** ((i - (n - 1) / 2) * 0.012)  # bars side by side, not on top of each other
            ax.errorbar([x * dodge for x in xs], ys, yerr=[[y - r["ppl_low"] for y, r in zip(ys, rows)],
                                      [r["ppl_high"] - y for y, r in zip(ys, rows)]],
                        fmt="none", ecolor=drawn, elinewidth=1, capsize=2)
            values += [r["ppl_low"] for r in rows] + [r["ppl_high"] for r in rows]
        if all(r.get("seed_min") is not None for r in rows):  # the spread between seeds, as a band
            seeded = True
            ax.fill_between(xs, [r["seed_min"] for r in rows], [r["seed_max"] for r in rows], color=drawn, alpha=0.15, lw=0)
    ax.axvline(train_len, color="black", ls="--", lw=1)
    ax.annotate(f"train length {train_len}", (train_len, 0.97), xycoords=("data", "axes fraction"),
                ha="left", va="top", fontsize=8, xytext=(4, 0), textcoords="offset points")
    ax.set_xscale("log", base=2)
    lengths = sorted({r["length"] for e in results["methods"].values() for r in e.get("eval", [])} | {train_len})
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.minorticks_off()
    if values and max(values) / min(values) > 8:  # exploding methods would flatten the rest
        ax.set_yscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
    ax.set_xlabel("evaluation length (bytes)")
    ax.set_ylabel("perplexity (per byte, lower is better)")
    note = "bars: 95% bootstrap interval" + ("; bands: min-max over seeds (mean drawn)" if seeded else "")
    ax.set_title(f"Train short, test long: the same validation tokens at every length\n({note})", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    if values:
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return fig


def training_figure(results: dict) -> Figure:
    """Training loss per step (a moving average of 1/50 of the run), one line per method."""
    fig = Figure(figsize=(8.5, 4.2), layout="constrained")
    ax = fig.subplots()
    for method, entry in results["methods"].items():
        losses = ((entry.get("across_seeds") or {}).get("train") or entry.get("train", {})).get("losses") or []
        if not losses:
            continue
        w = max(1, len(losses) // 50)
        smooth = [sum(losses[max(0, i - w + 1) : i + 1]) / len(losses[max(0, i - w + 1) : i + 1]) for i in range(len(losses))]
        ax.plot(range(1, len(losses) + 1), smooth, label=method, color=color(method), lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per byte)")
    ax.set_title(f"Training at length {results['config']['train_length']}")
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return fig


def recall_figure(results: dict) -> Figure:
    """Recall accuracy vs evaluation length, one panel per distance class (near, middle, far), one
    line per row, 95% intervals as bands; the training length marked."""
    classes = ("near", "middle", "far")
    fig = Figure(figsize=(12, 4.2), layout="constrained")
    axes = fig.subplots(1, len(classes), sharey=True)
    train_len = results["config"]["train_length"]
    lengths = sorted({r["length"] for e in results["methods"].values() for r in _shown(e)} | {train_len})
    n = len(results["methods"])
    for ax, cls in zip(axes, classes):
        for i, (method, entry) in enumerate(results["methods"].items()):
            rows = [r for r in _shown(entry) if r.get("accuracy") is not None]
            if not rows:
                continue
            # Many rows sit at 1.0 together: each drawn a little to the side, with its own marker.
            dodge = 2 ** ((i - (n - 1) / 2) * 0.02)
            xs = [r["length"] * dodge for r in rows]
            d = [r["distances"][cls] for r in rows]
            line, = ax.plot(xs, [x["accuracy"] for x in d], marker=MARKERS[i % len(MARKERS)], ms=4,
                            ls=style(method) if len(xs) > 1 else "none", label=method, color=color(method))
            if all(x.get("acc_low") is not None for x in d) and len(xs) > 1:
                ax.fill_between(xs, [x["acc_low"] for x in d], [x["acc_high"] for x in d], color=line.get_color(),
                                alpha=0.12, lw=0)
        ax.axvline(train_len, color="black", ls="--", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.minorticks_off()
        ax.set_ylim(-0.02, 1.02)
        where = 'just before the queries' if cls == 'near' else 'mid-sequence' if cls == 'middle' else 'at the start'
        ax.set_title(f"{cls}: the queried pairs {where}", fontsize=9)
        ax.set_xlabel("evaluation length (tokens)")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("exact-match accuracy of the answers")
    if axes[-1].lines:
        axes[-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle(f"Associative recall by distance (trained at {train_len}, dashed line; bands: 95% bootstrap interval)",
                 fontsize=10)
    return fig


def png_bytes(fig: Figure, dpi: int = 110) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def save(fig: Figure, path: str | Path) -> None:
    """Write a PNG atomically (temporary name, then rename)."""
    atomic_write(Path(path), lambda p: p.write_bytes(png_bytes(fig)))

