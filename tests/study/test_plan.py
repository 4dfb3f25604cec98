"""The study plan check (posenc.study.plan.check): rows whose options fail are refused before anything
is written, with the exact sentence the user reads; their neighbours are accepted."""

from __future__ import annotations

import json

import pytest

from posenc import cli
from posenc.errors import UsageError
from posenc.study import StudyConfig
from posenc.study.plan import check, parse_shard
from study_cli import one_error, study


@pytest.mark.parametrize("row,message", [
    ("t5:max_distance=abc", "methods: 't5:max_distance=abc': max_distance must be a positive integer (>= 1), got 'abc'"),
    ("rope:layout=diagonal", "methods: 'rope:layout=diagonal': layout must be one of ('half', 'interleaved'), got 'diagonal'"),
    ("t5:num_buckets=0", "methods: 't5:num_buckets=0': num_buckets must be a positive integer (>= 1), got 0"),
    ("rope:scaling=yarn", "methods: 'rope:scaling=yarn': scaling must be a dict such as a config's rope_scaling block, got str"),
    # 2: an infinite value, and a finite base out of range
    ("rope:base=1e400", "methods: 'rope:base=1e400': option base must be a finite number, got '1e400'"),
    ("rope:base=nan", "methods: 'rope:base=nan': option base must be a finite number, got 'nan'"),
    ("rope:base=1e13", "methods: 'rope:base=1e13': base must be a finite number in (1, 1e+12], got 10000000000000.0"),
    # 13: a key given twice
    ("rope:base=1,base=2", "methods: 'rope:base=1,base=2': option base is given twice; give it once"),
])
def test_a_bad_row_is_refused_before_anything_is_written(tmp_path, capsys, row, message) -> None:
    out = tmp_path / "run"
    assert study(out, "--methods", "alibi", row) == 2
    assert one_error(capsys) == message
    assert not out.exists()  # no directory, so the corrected command just works
    assert study(out, "--methods", "alibi") == 0
    # a resume with the bad row is refused the same way, and leaves the finished run as it was
    before = (out / "results.json").read_text()
    assert study(out, "--methods", "alibi", row, "--resume") == 2
    assert one_error(capsys) == message
    assert (out / "results.json").read_text() == before
    assert json.loads(before)["status"] == "done"


def test_neighbouring_good_rows_are_accepted() -> None:
    cfg = StudyConfig.from_preset("smoke", methods=["t5:max_distance=64", "rope:base=500000", "rope:layout=interleaved",
                                                    "rope:base=1e12"])
    check(cfg)


@pytest.mark.parametrize("extra,message", [
    (["--data", "nowhere.txt"], "data applies to the lm task (a corpus); the recall task generates its sequences, "
                                "so leave out data"),
    (["--valid-bytes", "1024"], "valid_bytes applies to the lm task (a corpus); the recall task generates its "
                                "sequences, so leave out valid_bytes"),
    (["--sliding", "16"], "sliding applies to the lm task (a corpus); the recall task generates its sequences, so "
                          "leave out sliding"),
    (["--recall-sequences", str(10**12)], "recall_sequences must be at most 1985 for eval lengths up to 67584 (one "
                                          "evaluation set of int64 tokens must fit in 1 GiB), got 1000000000000"),
])
def test_recall_refuses_options_it_would_ignore(tmp_path, capsys, extra, message) -> None:
    out = tmp_path / "run"
    lengths = ["--eval-lengths", "67584"] if "--recall-sequences" in extra else ["--eval-lengths", "64"]
    argv = ["study", "--preset", "recall", "--methods", "alibi", "--steps", "2", "--train-length", "64", *lengths,
            "--out", str(out), "--quiet", *extra]
    assert cli.main(argv) == 2
    assert one_error(capsys) == message
    assert not out.exists()


@pytest.mark.parametrize("text", ["²/3", "1/³", "１/2", "/2", "1/", "0/2", "3/2", "a/b"])
def test_a_shard_that_is_not_two_ascii_integers_is_a_usage_error(text: str) -> None:
    with pytest.raises(UsageError, match="shard"):
        parse_shard(text)
    assert parse_shard("2/3") == (2, 3)
