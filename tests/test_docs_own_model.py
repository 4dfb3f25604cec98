"""Every snippet of docs/own-model.md runs, in order, and prints what the page says it prints."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

import torch

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "own-model.md"


def blocks():
    """(code, expected output) pairs: a ```python block followed by a plain ``` block."""
    text = PAGE.read_text()
    return re.findall(r"```python\n(.*?)```\s*\n```\n(.*?)```", text, flags=re.S)


def test_every_snippet_prints_what_the_page_says():
    pairs = blocks()
    assert len(pairs) >= 6
    torch.manual_seed(0)
    scope: dict = {}
    for code, expected in pairs:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, str(PAGE), "exec"), scope)  # noqa: S102 (our own documentation)
        assert out.getvalue().strip() == expected.strip(), code
