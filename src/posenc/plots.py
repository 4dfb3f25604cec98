"""Figures of a study, drawn from its results dict: extrapolation (the paper's Figure 1 shape) and
training loss. Built on ``matplotlib.figure.Figure`` directly, so no pyplot state and no display.
"""

from __future__ import annotations

import io
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from .files import atomic_write

# One fixed colour per method, so every figure of every run reads the same.
COLORS = {
    "nope": "#7f7f7f", "sinusoidal": "#d62728", "learned": "#8c564b", "shaw": "#9467bd",
    "transformer_xl": "#e377c2", "t5": "#2ca02c", "rope": "#ff7f0e", "alibi": "#1f77b4",
}


def extrapolation_figure(results: dict) -> Figure:
    """Perplexity vs evaluation length (log x), one line per method, the training length marked."""
    fig = Figure(figsize=(8.5, 4.8), layout="constrained")
    ax = fig.subplots()
    train_len = results["config"]["train_length"]
    values = []
    for method, entry in results["methods"].items():
        rows = [r for r in entry.get("eval", []) if r.get("perplexity") is not None]
        if not rows:
            continue
        xs, ys = [r["length"] for r in rows], [r["perplexity"] for r in rows]
        values += ys
        label = method
        if any(r.get("perplexity") is None for r in entry["eval"]):  # a bounded method: say where it stops
            label += f" (cannot run past {entry.get('model', {}).get('max_positions') or max(xs)})"
        # One point is drawn as a marker, not a line: its legend entry then shows a marker too.
        ax.plot(xs, ys, marker="o", ms=4 if len(xs) > 1 else 7, ls="-" if len(xs) > 1 else "none",
                label=label, color=COLORS.get(method))
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
    ax.set_title("Train short, test long: the same validation tokens at every length")
    ax.grid(True, which="both", alpha=0.3)
    if values:
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return fig


def training_figure(results: dict) -> Figure:
    """Training loss per step (a moving average of 1/50 of the run), one line per method."""
    fig = Figure(figsize=(8.5, 4.2), layout="constrained")
    ax = fig.subplots()
    for method, entry in results["methods"].items():
        losses = entry.get("train", {}).get("losses") or []
        if not losses:
            continue
        w = max(1, len(losses) // 50)
        smooth = [sum(losses[max(0, i - w + 1) : i + 1]) / len(losses[max(0, i - w + 1) : i + 1]) for i in range(len(losses))]
        ax.plot(range(1, len(losses) + 1), smooth, label=method, color=COLORS.get(method), lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per byte)")
    ax.set_title(f"Training at length {results['config']['train_length']}")
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return fig


def png_bytes(fig: Figure, dpi: int = 110) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def save(fig: Figure, path: str | Path) -> None:
    """Write a PNG atomically (temporary name, then rename)."""
    atomic_write(Path(path), lambda p: p.write_bytes(png_bytes(fig)))

