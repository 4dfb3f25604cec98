"""Every snippet of docs/schedules.md runs, in order, and prints what the page says it prints."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

import pytest
import torch

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "schedules.md"


def test_every_snippet_prints_what_the_page_says():
    pytest.importorskip("transformers")
    pairs = re.findall(r"```python\n(.*?)```\s*\n```\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert len(pairs) == 3
    torch.manual_seed(0)
    scope: dict = {}
    for code, expected in pairs:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, str(PAGE), "exec"), scope)  # noqa: S102 (our own documentation)
        assert out.getvalue().strip() == expected.strip(), code
