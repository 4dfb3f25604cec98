"""Every snippet of docs/own-model.md runs, in order, and prints what the page says it prints."""

from __future__ import annotations

from snippets import check_page


def test_every_snippet_prints_what_the_page_says():
    check_page("own-model.md", at_least=6)
