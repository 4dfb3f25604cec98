"""``posenc study`` end to end at the smoke preset, evaluation semantics, report, and user errors."""

from __future__ import annotations

import csv
import json
import math
import re

import pytest
import torch

import posenc
from posenc import cli, study
from posenc.study import PRESETS, StudyConfig, evaluation
from posenc.study.data import load_corpus
from posenc.study.plan import check


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke") / "run"
    # one thread: a tiny model gains nothing from two, and loses a lot on a busy machine
    assert cli.main(["study", "--preset", "smoke", "--out", str(out), "--quiet", "--threads", "1"]) == 0
    return out, json.loads((out / "results.json").read_text())


def test_smoke_study_writes_every_output(smoke_run):
    out, results = smoke_run
    for name in ("results.json", "results.csv", "extrapolation.png", "results.md"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert (out / "extrapolation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "state").exists()  # training states are removed once a method is final
    assert not list(out.rglob(".*tmp*"))  # no temporary files left
    assert results["schema"] == study.SCHEMA and results["status"] == "done"
    assert results["seed"] == 0 and results["config"]["preset"] == "smoke"
    assert set(results["methods"]) == set(posenc.available())
    for key in ("files", "bytes", "sha256", "train_files", "valid_files", "valid_bytes_used"):
        assert key in results["corpus"]
    for key in ("posenc", "python", "torch", "platform"):
        assert key in results["versions"]
    cfg = results["config"]
    for method, e in results["methods"].items():
        assert e["status"] == "done"
        t = e["train"]
        assert len(t["losses"]) == t["steps"] == cfg["steps"]
        assert t["time_s"] > 0 and t["tokens_per_s"] > 0 and all(math.isfinite(v) for v in t["losses"])
        assert t["losses"][-1] < t["losses"][0]  # it learned something
        assert [r["length"] for r in e["eval"]] == cfg["eval_lengths"]
        for r in e["eval"]:
            assert r["tokens"] == cfg["valid_bytes"]  # the same tokens at every length
            if r["perplexity"] is not None:
                assert r["perplexity"] == pytest.approx(math.exp(r["loss"]))
                assert r["bits_per_byte"] == pytest.approx(r["loss"] / math.log(2))
                assert 1 < r["perplexity"] < 256
        assert (out / e["checkpoint"]).is_file()


def test_learned_positions_cannot_run_past_their_table(smoke_run):
    _, results = smoke_run
    train_len = results["config"]["train_length"]
    rows = results["methods"]["learned"]["eval"]
    assert rows[0]["length"] == train_len and rows[0]["perplexity"] is not None
    for r in rows[1:]:
        assert r["perplexity"] is None and r["bits_per_byte"] is None
        assert r["status"].startswith(f"cannot run past {train_len}")
    # every other method has a number at every length
    for method, e in results["methods"].items():
        if method != "learned":
            assert all(r["perplexity"] is not None for r in e["eval"]), method


def test_csv_and_markdown_match_json(smoke_run):
    out, results = smoke_run
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(results["methods"]) * len(results["config"]["eval_lengths"])
    by = {(r["method"], int(r["eval_length"])): r for r in rows}
    for method, e in results["methods"].items():
        for r in e["eval"]:
            cell = by[(method, r["length"])]["perplexity"]
            assert (cell == "") if r["perplexity"] is None else float(cell) == pytest.approx(r["perplexity"])
    md = (out / "results.md").read_text()
    assert md.count("\n") == len(results["methods"]) + 2
    assert re.search(r"\| learned \| [\d.]+ \[[\d.]+, [\d.]+\] \| n/a", md)  # with its 95% interval
    # "train s": three significant digits, so a run of a fraction of a second does not read 0
    for line in md.splitlines()[2:]:
        method, *_, cell = [c.strip() for c in line.strip("|").split("|")]
        t = results["methods"][method]["train"]["time_s"]
        assert 0 < float(cell) == pytest.approx(t, rel=5e-3, abs=0.5 if t >= 100 else 0)


def test_checkpoints_load_with_posenc_lm_and_reproduce_the_numbers(smoke_run):
    out, results = smoke_run
    cfg = results["config"]
    corpus = load_corpus("default", cfg["valid_bytes"])
    from posenc.study.distributed import Context

    ctx = Context(torch.device("cpu"))
    for method in ("t5", "learned", "shaw"):  # t5 shares one table across layers
        model = posenc.load_checkpoint(out / results["methods"][method]["checkpoint"])
        assert isinstance(model, posenc.LM) and model.config.encoding == method
        row = results["methods"][method]["eval"][0]
        again = study.evaluate(model, corpus.valid, row["length"], None, ctx)
        assert again["loss"] == pytest.approx(row["loss"], rel=1e-6)
    t5 = posenc.load_checkpoint(out / "checkpoints" / "t5.safetensors")
    assert all(b.attn.encoding is t5.encoding for b in t5.blocks)  # still shared after loading


def test_report_is_one_offline_html_page(smoke_run, tmp_path):
    out, results = smoke_run
    target = tmp_path / "r.html"
    assert cli.main(["report", str(out), "--out", str(target)]) == 0
    page = target.read_text()
    assert page.startswith("<!doctype html>") and page.rstrip().endswith("</html>")
    assert page.count("data:image/png;base64,") == 2
    assert not re.search(r"(src|href)=\"(https?:|//|[^d\"][^\"]*\.(png|css|js))", page)  # nothing external
    for method in results["methods"]:
        assert f"<td>{method}</td>" in page
    assert "cannot run past" in page and results["corpus"]["sha256"] in page
    assert cli.main(["report", str(tmp_path / "nothing")]) == 2


def test_sliding_stride_equal_to_length_is_the_non_overlapping_evaluation(smoke_run):
    out, results = smoke_run
    from posenc.study.distributed import Context

    ctx = Context(torch.device("cpu"))
    valid = load_corpus("default", 1024).valid
    model = posenc.load_checkpoint(out / "checkpoints" / "alibi.safetensors")
    plain = study.evaluate(model, valid, 64, None, ctx)
    same = study.evaluate(model, valid, 64, 64, ctx)
    slid = study.evaluate(model, valid, 64, 16, ctx)
    assert plain == same
    assert slid["tokens"] == plain["tokens"] == 1024
    assert slid["loss"] != plain["loss"]  # more context per scored token: a different number


def test_evaluate_batches_do_not_change_the_result(smoke_run, monkeypatch):
    out, _ = smoke_run
    from posenc.study.distributed import Context

    ctx = Context(torch.device("cpu"))
    valid = load_corpus("default", 1000).valid  # 1000 is not a multiple of 64: last window moves back
    model = posenc.load_checkpoint(out / "checkpoints" / "rope.safetensors")
    big = study.evaluate(model, valid, 64, None, ctx)
    monkeypatch.setattr(evaluation, "EVAL_TOKENS", 64)  # one window per forward
    one = study.evaluate(model, valid, 64, None, ctx)
    assert one["tokens"] == big["tokens"] == 1000
    assert one["loss"] == pytest.approx(big["loss"], rel=1e-6)
    # reference: score each target once with a hand-written loop
    total, nll = 0, 0.0
    with torch.no_grad():
        for begin in range(0, 1000, 64):
            start = min(begin, 1000 - 64)
            ids = valid[start : start + 65].long()[None]
            logp = torch.log_softmax(model(ids[:, :-1]), -1)[0]
            for t in range(begin - start, 64):
                nll -= float(logp[t, ids[0, t + 1]])
                total += 1
    assert total == 1000
    assert big["loss"] == pytest.approx(nll / total, rel=1e-5)


def small_args(out, *extra):
    return ["study", "--preset", "smoke", "--methods", "alibi", "--steps", "4", "--out", str(out), "--quiet",
            "--threads", "1", *extra]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--methods", "alibi", "nosuch"], "unknown encoding 'nosuch'"),
        (["--eval-lengths", "0", "32"], "eval_lengths must be integers >= 1"),
        (["--eval-lengths", "99999"], "exceeds the 4096 validation tokens"),
        (["--sliding", "64"], "sliding stride"),
        (["--steps", "0"], "steps must be"),
        (["--device", "tpu"], "device must be"),
    ],
)
def test_bad_input_is_one_clear_line_before_training(tmp_path, capsys, extra, message):
    out = tmp_path / "run"
    assert cli.main([*small_args(out), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1
    assert not out.exists()  # nothing trained, nothing written


@pytest.mark.parametrize(
    "extra",
    [["--methods", "nosuch"], ["--eval-lengths", "99999"], ["--dim", "31"], ["--data", "/no/such/path"],
     ["--resume", "--lr", "-1"]],
)
def test_user_mistakes_are_usage_errors(tmp_path, extra):
    """The study path raises UsageError (printed in one line by the CLI), never a bare ValueError."""
    from posenc.study.cli import run_study

    with pytest.raises(posenc.UsageError):
        run_study(cli.build_parser().parse_args([*small_args(tmp_path / "run"), *extra]))


def test_bad_corpus_and_out_dir(tmp_path, capsys):
    binary = tmp_path / "b.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    empty = tmp_path / "empty"
    empty.mkdir()
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    for extra, message in (
        (["--data", str(binary)], "not UTF-8 text"),
        (["--data", str(empty)], "corpus is empty"),
    ):
        assert cli.main([*small_args(tmp_path / "run"), *extra]) == 2
        assert message in capsys.readouterr().err
    assert cli.main(small_args(blocker / "run")) == 2
    assert "not writable" in capsys.readouterr().err


def test_existing_run_needs_resume_and_the_same_config(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(small_args(out)) == 0
    before = (out / "results.json").read_text()
    assert cli.main(small_args(out)) == 2
    assert "continue it with resume (--resume)" in capsys.readouterr().err
    assert cli.main([*small_args(out, "--resume"), "--lr", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "different config" in err and "lr" in err
    assert (out / "results.json").read_text() == before
    # resuming with the same options: nothing to do, nothing changes in the numbers
    assert cli.main(small_args(out, "--resume")) == 0
    after = json.loads((out / "results.json").read_text())
    assert after["methods"] == json.loads(before)["methods"]
    # --resume without options takes them from the saved run
    assert cli.main(["study", "--out", str(out), "--resume", "--quiet", "--threads", "1"]) == 0
    # adding a method to a finished run trains only that method
    assert cli.main([*small_args(out, "--resume"), "--methods", "alibi", "nope"]) == 0
    final = json.loads((out / "results.json").read_text())
    assert list(final["methods"]) == ["alibi", "nope"]
    assert final["methods"]["alibi"] == after["methods"]["alibi"]


MODERN = {"xpos", "xpos+blockwise", "kerple", "sandwich", "fire", "cope", "deberta", "fox", "pope", "inkling", "dpb", "rope",
          "rope+random", "rope+drop", "alibi", "nope"}


def test_presets_are_valid_and_default_matches_design():
    for name in PRESETS:
        cfg = check(StudyConfig.from_preset(name, device="cpu"))
        # smoke trains every registered method; the others name theirs, so a new method costs them nothing
        assert cfg.methods == (posenc.available() if name == "smoke" else PRESETS[name]["methods"])
        assert {k: getattr(cfg, k) for k in PRESETS[name]} == PRESETS[name]
    classic = ["nope", "sinusoidal", "learned", "shaw", "transformer_xl", "t5", "rope", "alibi"]
    scalings = ["rope+linear", "rope+ntk", "rope+dynamic", "rope+yarn", "rope+llama3", "rope+longrope"]
    assert PRESETS["default"]["methods"] == [*classic, *scalings]
    assert PRESETS["recall"]["methods"] == [*classic, *scalings, "rope+random", "rope+drop"] and PRESETS["recall"]["task"] == "recall"
    assert set(PRESETS["modern"]["methods"]) == MODERN
    # the dataclass's own defaults are the default preset's: one source of every size
    assert StudyConfig() == StudyConfig.from_preset("default")
    d = StudyConfig.from_preset("default")
    keys = ("depth", "dim", "num_heads", "train_length", "batch_size", "steps", "lr")
    assert tuple(getattr(d, k) for k in keys) == tuple(PRESETS["default"][k] for k in keys)
    assert d.valid_bytes == 64 * 1024 and max(d.eval_lengths) >= 8 * d.train_length
    p = StudyConfig.from_preset("paper")
    assert p.train_length == 512 and max(p.eval_lengths) == 16 * 512
    with pytest.raises(posenc.UsageError, match="preset"):
        StudyConfig.from_preset("huge")


def test_command_line_options_come_from_the_config_fields(capsys):
    from dataclasses import fields

    with pytest.raises(SystemExit):
        cli.main(["study", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for f in fields(StudyConfig):
        assert f"--{f.name.replace('_', '-')}" in text, f.name
    # per-preset defaults are named in the help, read from PRESETS (not a hand-kept string)
    assert "validation tokens scored at every length (per preset: " + ", ".join(
        f"{name} {PRESETS[name]['valid_bytes']}" for name in PRESETS) + ")" in text


@pytest.mark.parametrize("argv, expected", [
    ([], "runs/default"),
    (["--preset", "modern"], "runs/modern"),
    (["--task", "recall"], "runs/recall"),  # --task recall without a preset takes the recall preset
    (["--task", "recall", "--preset", "default"], "runs/default"),
    (["--out", "x/y"], "x/y"),
])
def test_the_default_out_folder_is_named_after_the_preset_the_run_takes(argv, expected):
    from pathlib import Path

    from posenc.study.cli import config_from_args, default_out

    args = cli.build_parser().parse_args(["study", *argv])
    assert default_out(args) == Path(expected)
    if "--out" not in argv:
        assert default_out(args).name == config_from_args(args).preset
