"""Figure of a layer schedule: which keys each layer's queries see, and with which encoding.

Left: one row per layer, the label saying its encoding, options and attention kind (the schedule's
text form of that layer). Right: for each layer, the keys the query at position ``query`` sees over
positions 0..``length``-1 (full: all up to the query; a window: the last W; a chunk: its own chunk;
bidirectional layers both sides), one colour per encoding and options (layers of one colour share
an encoding instance where the method shares), white where nothing is seen. Built on
``matplotlib.figure.Figure`` directly (no pyplot state), as :mod:`posenc.show.scaling`.
"""

from __future__ import annotations

import torch
from matplotlib.figure import Figure

from ..backends.parts.windows import Extras, visible
from ..errors import UsageError
from ..model.schedule import Schedule


def seen(schedule: Schedule, length: int, query: int, causal: bool = True) -> torch.Tensor:
    """(layers, length) bool: True where the query at ``query`` sees the key in that layer.

    Raises:
        UsageError: ``query`` is not in [0, ``length``).
    """
    if not 0 <= query < length:
        raise UsageError(f"query must be in [0, length={length}), got {query}")
    positions = torch.arange(length)
    rows = [visible(positions[query : query + 1], positions, Extras(layer.window, layer.chunk), causal)[0]
            for layer in schedule.layers]
    return torch.stack(rows)  # (L, length)


def schedule_figure(schedule: Schedule | str | list, depth: int | None = None, length: int = 256, query: int | None = None,
                    causal: bool = True) -> Figure:
    """The figure (see the module docstring) of ``schedule`` (a Schedule, its text with ``depth``, or
    its json list); ``query`` defaults to the last position."""
    schedule = Schedule.of(schedule, depth)
    query = length - 1 if query is None else query
    mask = seen(schedule, length, query, causal)
    keys = list(dict.fromkeys(layer.sharing_key for layer in schedule.layers))  # method and options, in order
    colours = {key: i % 10 + 1 for i, key in enumerate(keys)}
    image = torch.zeros(mask.shape)
    for i, layer in enumerate(schedule.layers):
        image[i][mask[i]] = colours[layer.sharing_key]
    n = len(schedule)
    fig = Figure(figsize=(9, 0.9 + 0.28 * n))
    ax = fig.add_subplot(1, 1, 1)
    from matplotlib import colormaps
    from matplotlib.colors import ListedColormap
    from matplotlib.typing import ColorType

    colors: list[ColorType] = ["white", *[colormaps["tab10"](i) for i in range(10)]]  # white: not seen
    palette = ListedColormap(colors)
    ax.imshow(image.numpy(), aspect="auto", interpolation="nearest", cmap=palette, vmin=0, vmax=10)
    ax.set_yticks(range(n), [f"{i}: {layer.to_text()}" for i, layer in enumerate(schedule.layers)], fontsize=7)
    ax.axvline(query, color="black", linewidth=0.8)
    ax.set_xlabel(f"key position (the query at {query} is the line)")
    ax.set_title(f"which keys each layer sees; one colour per encoding and options ({len(keys)})", fontsize=9)
    fig.tight_layout()
    return fig


__all__ = ["schedule_figure", "seen"]
