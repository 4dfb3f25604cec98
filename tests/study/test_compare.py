"""Differences that hold across seeds (posenc.study.compare): a row is marked below or above
another only where both the windows' 95% intervals and the seeds' ranges are apart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posenc import cli
from posenc.errors import UsageError
from posenc.study import compare


def fig(value, low, high, seed_min=None, seed_max=None) -> dict:
    return {"value": value, "low": low, "high": high, "seed_min": seed_min, "seed_max": seed_max}


@pytest.mark.parametrize(
    ("a", "b", "want"),
    [
        # both apart: separated, with the direction of the number
        (fig(4.0, 3.9, 4.1, 3.95, 4.05), fig(5.0, 4.9, 5.1, 4.8, 5.2), "below"),
        (fig(5.0, 4.9, 5.1, 4.8, 5.2), fig(4.0, 3.9, 4.1, 3.95, 4.05), "above"),
        # intervals apart, seeds overlap (a seed of b lies among a's): training noise unresolved
        (fig(4.0, 3.9, 4.1, 3.5, 4.6), fig(5.0, 4.9, 5.1, 4.5, 5.2), "overlaps"),
        # seeds apart, intervals overlap: the text does not resolve the means
        (fig(4.0, 3.0, 5.0, 3.95, 4.05), fig(5.0, 4.5, 5.5, 4.9, 5.1), "overlaps"),
        # touching ends share a point: not apart
        (fig(4.0, 3.9, 4.5, 3.95, 4.05), fig(5.0, 4.5, 5.1, 4.9, 5.1), "overlaps"),
        # one seed: the spread is unknown
        (fig(4.0, 3.9, 4.1), fig(5.0, 4.9, 5.1, 4.8, 5.2), "one seed"),
        # a window file missing: the interval is unknown
        (fig(4.0, None, None, 3.95, 4.05), fig(5.0, 4.9, 5.1, 4.8, 5.2), "overlaps"),
        (None, fig(5.0, 4.9, 5.1, 4.8, 5.2), "n/a"),
    ],
)
def test_mark_needs_both_the_intervals_and_the_seeds_apart(a, b, want) -> None:
    assert compare.mark(a, b) == want


def lm_row(length: int, ppl: float, low: float, high: float, smin: float, smax: float) -> dict:
    return {"length": length, "perplexity": ppl, "ppl_low": low, "ppl_high": high, "seed_min": smin, "seed_max": smax}


def synthetic() -> dict:
    def entry(rows):
        return {"status": "done", "eval": [], "across_seeds": {"seeds": [0, 1, 2], "eval": rows, "train": {}}}

    return {"config": {"train_length": 64, "task": "lm"}, "methods": {
        "a": entry([lm_row(64, 4.0, 3.9, 4.1, 3.95, 4.05), lm_row(128, 4.0, 3.8, 4.2, 3.9, 4.1)]),
        "b": entry([lm_row(64, 5.0, 4.9, 5.1, 4.9, 5.1), lm_row(128, 4.1, 3.9, 4.3, 4.0, 4.2)]),
        "c": {"status": "done", "eval": [lm_row(64, 6.0, 5.9, 6.1, None, None)]},  # one seed, no 128
    }}


def test_versus_and_matrix_on_a_study() -> None:
    res = synthetic()
    assert compare.versus(res, "b") == {"a": {64: "below", 128: "overlaps"}, "b": {64: "overlaps", 128: "overlaps"},
                                           "c": {64: "one seed", 128: "n/a"}}
    m = compare.matrix(res, 64)
    assert m["a"] == {"b": "below", "c": "one seed"} and m["b"]["a"] == "above"
    text = compare.markdown_versus(res, "b")
    assert text.splitlines()[0] == "| method | 64* | 128 |" and "| a | below | overlaps |" in text
    with pytest.raises(UsageError, match="versus: 'd' is not a row"):
        compare.versus(res, "d")


def test_recall_marks_compare_the_far_accuracy() -> None:
    def row(acc, low, high, smin, smax):
        far = {"accuracy": acc, "acc_low": low, "acc_high": high, "seed_min": smin, "seed_max": smax}
        return {"length": 128, "accuracy": 0.5, "distances": {"far": far}}

    res = {"config": {"train_length": 64, "task": "recall"}, "methods": {
        "x": {"eval": [], "across_seeds": {"eval": [row(1.0, 1.0, 1.0, 1.0, 1.0)]}},
        "y": {"eval": [], "across_seeds": {"eval": [row(0.4, 0.3, 0.5, 0.35, 0.45)]}},
    }}
    assert compare.versus(res, "y")["x"] == {128: "above"}


@pytest.fixture(scope="module")
def two_seeds(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sep") / "run"
    assert cli.main(["study", "--preset", "smoke", "--valid-bytes", "512", "--eval-lengths", "32", "64", "--quiet",
                     "--threads", "1", "--methods", "alibi", "nope", "--steps", "4", "--seeds", "2",
                     "--out", str(out)]) == 0
    return out


def test_report_marks_follow_the_rule_from_the_committed_numbers(two_seeds, capsys) -> None:
    res = json.loads((two_seeds / "results.json").read_text())
    assert cli.main(["report", str(two_seeds), "--markdown", "--versus", "nope"]) == 0
    text = capsys.readouterr().out
    a = {r["length"]: r for r in res["methods"]["alibi"]["across_seeds"]["eval"]}
    b = {r["length"]: r for r in res["methods"]["nope"]["across_seeds"]["eval"]}
    cells = []
    for n in (32, 64):  # the rule written out on the numbers in results.json
        x, y = a[n], b[n]
        apart = (x["ppl_high"] < y["ppl_low"] or y["ppl_high"] < x["ppl_low"]) and (
            x["seed_max"] < y["seed_min"] or y["seed_max"] < x["seed_min"])
        cells.append(("below" if x["perplexity"] < y["perplexity"] else "above") if apart else "overlaps")
    assert f"| alibi | {' | '.join(cells)} |" in text
    assert "(seeds " in text  # the table shows the seeds' spread
    page = two_seeds / "report.html"
    assert cli.main(["report", str(two_seeds), "--versus", "alibi"]) == 0
    html = page.read_text()
    assert "Differences that hold across seeds" in html and "Each row against alibi" in html


def test_report_refuses_an_unknown_versus_row_and_markdown_with_out(two_seeds, tmp_path, capsys) -> None:
    assert cli.main(["report", str(two_seeds), "--markdown", "--versus", "rope"]) == 2
    assert "versus: 'rope' is not a row of this study; its rows are alibi, nope" in capsys.readouterr().err
    assert cli.main(["report", str(two_seeds), "--markdown", "--out", str(tmp_path / "x.md")]) == 2
    assert "markdown:" in capsys.readouterr().err and not (tmp_path / "x.md").exists()
