"""Run a documentation page's snippets (imported by the docs tests, not collected itself).

A snippet is a ```python block followed by a plain ``` block holding what it prints; the blocks
of a page run in order in one namespace, as a reader would paste them."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

import torch

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"


def check_page(name: str, at_least: int) -> None:
    """Every snippet of ``docs/NAME`` prints what the page says (at least ``at_least`` of them)."""
    page = DOCS / name
    pairs = re.findall(r"```python\n(.*?)```\s*\n```\n(.*?)```", page.read_text(), flags=re.S)
    assert len(pairs) >= at_least, f"{name}: {len(pairs)} snippets"
    torch.manual_seed(0)
    scope: dict = {}
    for code, expected in pairs:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, str(page), "exec"), scope)  # noqa: S102 (our own documentation)
        assert out.getvalue().strip() == expected.strip(), code
