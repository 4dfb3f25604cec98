"""A study's results under faults (``posenc study`` and ``posenc report``): extreme values (strict JSON),
diverged rows, hostile results files.
Each case asserts the exact sentence the user reads; every run is a few steps of a tiny model."""

from __future__ import annotations

import json
import math
import re
import shutil
import types
from pathlib import Path

import pytest

from posenc import cli, files
from posenc.errors import UsageError
from posenc.study import StudyConfig, run_experiment
from posenc.study import train as train_module
from study_cli import one_error, study

# ---- a row's options are checked before any directory or file exists ---------------------------








# ---- results files are strict JSON ---------------------------------------------------------------


def test_results_files_refuse_nan(tmp_path) -> None:
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        files.write_json(tmp_path / "x.json", {"perplexity": math.nan})
    assert not (tmp_path / "x.json").exists()
    files.write_json(tmp_path / "x.json", {"perplexity": 1.5})
    assert json.loads((tmp_path / "x.json").read_text()) == {"perplexity": 1.5}


# ---- a diverged row is recorded as diverged, and the study goes on ---------------------------------


@pytest.fixture
def diverging(monkeypatch):
    """Rows named in the returned set get a NaN loss from their third step on."""
    names: set[str] = set()
    real = train_module.F.cross_entropy
    state = {"label": None, "step": 0}
    real_train = train_module.train

    def train(label, *args, **kwargs):
        state["label"], state["step"] = label, 0
        return real_train(label, *args, **kwargs)

    def cross_entropy(*args, **kwargs):
        state["step"] += 1
        loss = real(*args, **kwargs)
        return loss * math.nan if state["label"] in names and state["step"] >= 3 else loss

    monkeypatch.setattr(train_module, "F", types.SimpleNamespace(cross_entropy=cross_entropy))
    monkeypatch.setattr("posenc.study.pipeline.train", train)
    return names


def test_a_diverged_row_is_marked_with_its_step_and_the_others_run(tmp_path, capsys, diverging) -> None:
    diverging.add("t5")
    out = tmp_path / "run"
    assert study(out, "--methods", "t5", "alibi", "kerple") == 0
    err = capsys.readouterr().err
    assert ("[t5] diverged: non-finite loss at step 3 (loss nan, gradient norm nan); recorded as diverged, going on "
            "with the other rows") in err
    results = json.loads((out / "results.json").read_text())  # strict JSON: no NaN anywhere
    assert results["status"] == "done"
    t5 = results["methods"]["t5"]
    assert (t5["status"], t5["train"]["diverged_at_step"], t5["eval"]) == ("diverged", 3, [])
    assert len(t5["train"]["losses"]) == 2 and all(math.isfinite(v) for v in t5["train"]["losses"])
    for other in ("alibi", "kerple"):  # bias rows after it: trained and scored
        assert results["methods"][other]["status"] == "done"
        assert math.isfinite(results["methods"][other]["eval"][0]["perplexity"])
    assert "| t5 | diverged (step 3) | - |" in (out / "results.md").read_text()
    assert not (out / "state" / "t5.pt").exists()
    # resume: the diverged row is not retried, the study stays done
    before = (out / "results.json").read_text()
    assert study(out, "--methods", "t5", "alibi", "kerple", "--resume") == 0
    after = json.loads((out / "results.json").read_text())
    assert after["status"] == "done" and after["methods"] == json.loads(before)["methods"]
    assert cli.main(["report", str(out)]) == 0
    page = (out / "report.html").read_text()
    assert "diverged at step 3" in page


def test_an_evaluation_row_of_a_diverged_base_is_diverged_too(tmp_path, capsys, diverging) -> None:
    diverging.add("rope")
    out = tmp_path / "run"
    assert study(out, "--methods", "rope", "rope+yarn", "alibi") == 0
    results = json.loads((out / "results.json").read_text())
    assert results["methods"]["rope"]["status"] == "diverged"
    assert results["methods"]["rope+yarn"]["status"] == "diverged"
    assert results["methods"]["rope+yarn"]["train"]["reason"] == "its base row rope diverged"
    assert results["methods"]["alibi"]["status"] == "done"


def test_blown_up_weights_that_crash_a_bias_backend_are_divergence(tmp_path, capsys) -> None:
    # lr 1e30: after one step the weights are ~1e30, q . k overflows and the blocked backend's plan
    # sees NaN (before: ValueError: cannot convert float NaN to integer, the whole study gone).
    cfg = StudyConfig.from_preset("smoke", methods=["alibi", "nope"], steps=4, lr=1e30, dim=16, num_heads=2, depth=1,
                                  eval_lengths=[32], valid_bytes=512, batch_size=2, checkpoint_every=2)
    results = run_experiment(cfg, tmp_path / "run", progress=False)
    alibi = results["methods"]["alibi"]
    assert alibi["status"] == "diverged" and alibi["train"]["diverged_at_step"] == 2
    assert alibi["train"]["reason"].startswith("non-finite activations at step 2 (weights up to 1")
    assert results["methods"]["nope"]["status"] in ("diverged", "done")


def test_a_backend_error_with_sane_weights_is_not_called_divergence(monkeypatch, tmp_path) -> None:
    def broken(self, *a, **k):
        raise ValueError("a bug")

    import posenc
    monkeypatch.setattr(posenc.LM, "forward", broken)
    cfg = StudyConfig.from_preset("smoke", methods=["alibi"], steps=2, dim=16, num_heads=2, depth=1,
                                  eval_lengths=[32], valid_bytes=512, batch_size=2, checkpoint_every=2)
    with pytest.raises(ValueError, match="a bug"):
        run_experiment(cfg, tmp_path / "run", progress=False)


# ---- 6, 7, 13. hostile or damaged results files ---------------------------------------------------------


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished") / "run"
    assert study(out, "--methods", "alibi") == 0
    return out


def edited(finished: Path, tmp_path: Path, edit) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    results = json.loads((out / "results.json").read_text())
    edit(results)
    (out / "results.json").write_text(json.dumps(results))
    return out


SCRIPT = "<script>alert(1)</script>"


@pytest.mark.parametrize("where", ["batch_size", "steps", "train_length", "recall_sequences", "valid_bytes_used",
                                   "versions", "method", "status", "option"])
def test_report_escapes_everything_from_files(finished, tmp_path, capsys, where) -> None:
    def edit(r):
        if where == "valid_bytes_used":
            r["corpus"]["valid_bytes_used"] = SCRIPT
        elif where == "versions":
            r["versions"]["torch"] = SCRIPT
        elif where == "method":
            r["methods"][SCRIPT] = r["methods"].pop("alibi")
        elif where == "status":
            r["status"] = SCRIPT
        elif where == "option":
            r["methods"]["alibi"]["row"]["options"] = {"x": SCRIPT}
        elif where == "recall_sequences":
            r["config"]["recall_sequences"] = SCRIPT
        else:
            r["config"][where] = SCRIPT
    out = edited(finished, tmp_path, edit)
    code = cli.main(["report", str(out)])
    if where in ("batch_size", "steps", "train_length", "recall_sequences"):  # numbers: refused as damaged
        assert code == 2
        assert one_error(capsys) == (f"{out / 'results.json'} is not a complete posenc study result (config {where} is "
                                     f"{SCRIPT!r}, not an integer); it was edited or damaged")
        return
    assert code == 0
    page = (out / "report.html").read_text()
    assert "<script" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_report_page_has_no_external_resource(finished, tmp_path) -> None:
    from html.parser import HTMLParser

    out = edited(finished, tmp_path, lambda r: r["versions"].update(x='<img src="http://example.com/x.png">'))
    assert cli.main(["report", str(out)]) == 0
    tags, links = [], []

    class Tags(HTMLParser):
        def handle_starttag(self, tag, attrs):
            tags.append(tag)
            links.extend(v for k, v in attrs if k in ("src", "href", "srcset", "action", "data") and v)

    Tags().feed((out / "report.html").read_text())
    assert "script" not in tags and "link" not in tags and "iframe" not in tags
    assert links and all(link.startswith("data:image/png;base64,") for link in links)


def test_a_string_train_length_is_refused_not_a_crash(finished, tmp_path, capsys) -> None:
    out = edited(finished, tmp_path, lambda r: r["config"].update(train_length="32"))
    assert cli.main(["report", str(out)]) == 2
    assert one_error(capsys) == (f"{out / 'results.json'} is not a complete posenc study result (config train_length is "
                                 "'32', not an integer); it was edited or damaged")
    out2 = edited(finished, tmp_path / "b", lambda r: r["methods"]["alibi"]["eval"][0].update(length="32"))
    assert cli.main(["report", str(out2)]) == 2
    assert one_error(capsys) == (f"{out2 / 'results.json'} is not a complete posenc study result (method 'alibi' has an "
                                 "eval row whose length, perplexity or status has the wrong type); it was edited or damaged")


def test_row_names_from_files_never_become_paths_outside_the_run(finished, tmp_path, capsys) -> None:
    secret = tmp_path / "secret"
    (secret / "s0-L32.json").parent.mkdir(parents=True)
    (secret / "s0-L32.json").write_text(json.dumps({"nll": [1.0], "count": [1]}))
    name = "rope:layout=../../../secret"

    def edit(r):
        r["methods"][name] = r["methods"]["alibi"]  # a text option value with separators
    a = edited(finished, tmp_path / "a", edit)
    b = edited(finished, tmp_path / "b", edit)
    opened = []
    real = Path.read_text

    def spy(self, *args, **kwargs):
        opened.append(self.resolve())
        return real(self, *args, **kwargs)

    import unittest.mock
    with unittest.mock.patch.object(Path, "read_text", spy):
        assert cli.main(["report", str(a), str(b), "--out", str(tmp_path / "c.html")]) == 0
    assert all(p.is_relative_to(a.resolve()) or p.is_relative_to(b.resolve()) for p in opened if p.suffix == ".json")
    from posenc.study import rows
    from posenc.study.results import Paths
    assert rows.parse(name).stem == "rope_layout-.._.._.._secret"
    with pytest.raises(UsageError, match=re.escape("the file name '..' (from a row name or seed in it) is not a plain "
                                                   "file name; it was edited or damaged")):
        Paths(a).window_scores("..", 0, 32)
