"""README.md's Python snippets run as a reader would paste them: in order, in one namespace."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"

pytestmark = pytest.mark.usefixtures("one_thread")


def test_every_readme_snippet_runs() -> None:
    pytest.importorskip("transformers")
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 3
    torch.manual_seed(0)
    scope: dict = {}
    for code in blocks:
        exec(compile(code, str(README), "exec"), scope)  # noqa: S102 (our own documentation)
    assert scope["out"].shape == (1, 48)  # the HF snippet's generate: the prompt and 8 new tokens


def test_readme_commands_are_the_ci_ones() -> None:
    text = README.read_text()
    ci = (README.parent / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci in text, "README's test command must be the one .ci/run runs"
    assert "bash setup.sh && .venv/bin/posenc study --preset default --jobs auto --out runs/default" in text
