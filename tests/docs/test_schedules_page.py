"""Every snippet of docs/schedules.md runs, in order, and prints what the page says it prints."""

from __future__ import annotations

import pytest

from snippets import check_page


def test_every_snippet_prints_what_the_page_says():
    pytest.importorskip("transformers")
    check_page("schedules.md", at_least=3)
