"""The plot of a run: median time per method, with the spread over rounds as error bars.

One panel per mode. With several lengths: time against length, log-log, one line per method and
implementation. With one length, lines would put every method on one vertical line, so it is a
grouped bar chart instead: methods along x, one bar per implementation, one colour per
implementation. The control row is left out (it is NoPE again).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

from ..files import atomic_write
from .job import POSENC
from .levels import LEVELS

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

LINE_STYLES = ("-", "--", ":", "-.")


def _err(rows: list[dict]) -> list[list[float]]:
    """Asymmetric error bars (below, above the median) from each row's min and max round time."""
    below, above = [], []
    for r in rows:
        times = [t for t in r.get("round_median_s", []) if t is not None] or [r["median_s"]]
        below.append(r["median_s"] - min(times))
        above.append(max(times) - r["median_s"])
    return [below, above]


def _bars(ax: Axes, rows: list[dict], impls: list[str], methods: list[str]) -> None:
    width = 0.8 / len(impls)
    for k, impl in enumerate(impls):
        mine = {r["method"]: r for r in rows if r["impl"] == impl}
        xs = [i + (k - (len(impls) - 1) / 2) * width for i, m in enumerate(methods) if m in mine]
        got = [mine[m] for m in methods if m in mine]
        ax.bar(xs, [r["median_s"] for r in got], width, yerr=_err(got), capsize=3, color=f"C{k}", label=impl)
    ax.set_xticks(range(len(methods)), methods, rotation=30, ha="right")
    ax.grid(True, axis="y", alpha=0.3)


def _lines(ax: Axes, rows: list[dict], impls: list[str], methods: list[str], lengths: list[int]) -> None:
    import matplotlib.ticker

    for method in methods:
        for k, impl in enumerate(impls):
            got = sorted((r for r in rows if r["method"] == method and r["impl"] == impl), key=lambda r: r["length"])
            if not got:
                continue
            label = method if impl == POSENC else f"{method} ({impl})"
            ax.errorbar([r["length"] for r in got], [r["median_s"] for r in got], yerr=_err(got), capsize=3,
                        linestyle=LINE_STYLES[k % len(LINE_STYLES)], color=f"C{methods.index(method) % 10}",
                        marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("sequence length N")
    ax.grid(True, which="both", alpha=0.3)


def figure(cells: list[dict], title: str = "") -> Figure:
    """The matplotlib figure of ``cells`` (table rows, see :func:`posenc.bench.stats.summarize`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in cells if r.get("status") == "ok" and not r["control"]]
    level = LEVELS[cells[0]["level"]] if cells else None
    modes = [m for m in (level.modes if level else ()) if any(r["mode"] == m for r in rows)] or ["(none)"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    lengths = sorted({r["length"] for r in rows})
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        mine = [r for r in rows if r["mode"] == mode]
        if len(lengths) == 1:
            _bars(ax, mine, impls, methods)
            ax.set_xlabel(f"method (N={lengths[0]})")
        elif mine:
            _lines(ax, mine, impls, methods, lengths)
        unit = level.unit(mode) if level else "s"
        ax.set_ylabel(f"median {unit} (error bars: min-max over rounds)")
        ax.set_title(mode)
    handles: dict = {}  # one legend for all panels, outside them, so nothing is hidden
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="center right", fontsize=7)
    fig.suptitle(textwrap.fill(title, 70 * len(modes)), fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.85 if handles else 1, 1))
    return fig


def plot(cells: list[dict], path: Path, title: str = "") -> None:
    """Write the plot of ``cells`` to ``path`` (PNG, atomically)."""
    import matplotlib.pyplot as plt

    fig = figure(cells, title)
    try:
        atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=110))
    finally:
        plt.close(fig)
