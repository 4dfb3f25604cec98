"""study/progress.py: the events a run reports (study/events.py) drawn as log lines, estimates and
bars; what --quiet keeps (warnings) and what a worker's process shows (nothing of its own)."""

from __future__ import annotations

import re

from posenc.study import progress
from posenc.study.events import (
    LengthScored,
    LengthStarted,
    Log,
    RunDone,
    ScoringEnded,
    ScoringStarted,
    SearchScored,
    StepDone,
    StudyEnded,
    StudyStarted,
    TrainEnded,
    TrainStarted,
    Warn,
    WindowsScored,
)


def lines(capsys) -> list[str]:
    return capsys.readouterr().err.splitlines()


def test_training_lines_a_tenth_apart_and_the_resumed_step(capsys):
    ui = progress.Progress(True, bars=False)
    ui(TrainStarted("rope", 20, 4))
    for step in range(5, 21):
        ui(StepDone("rope", step, 20, 1.5, 1000.0))
    ui(TrainEnded("rope"))
    out = lines(capsys)
    assert out[0] == "[rope] resuming from step 4/20"
    steps = [int(m.group(1)) for e in out[1:] if (m := re.fullmatch(r"\[rope\] step (\d+)/20 loss 1\.500 1,000 tok/s eta \S+", e))]
    assert steps == [6, 8, 10, 12, 14, 16, 18, 20] and len(out) == 9


def test_a_long_stage_is_announced_even_when_quiet(capsys, monkeypatch):
    monkeypatch.setattr(progress, "LONG_S", 0.0)
    ui = progress.Progress(False)
    ui(TrainStarted("alibi", 10, 0))
    for step in (1, 2, 3):
        ui(StepDone("alibi", step, 10, 2.0, 10.0))
    ui(LengthStarted("alibi", 64))
    ui(WindowsScored(4, 16))
    ui(WindowsScored(8, 16))
    ui(LengthScored("alibi", 64, "ppl 3.0"))
    ui(Log("a line"))
    ui(Warn("a warning"))
    out = lines(capsys)
    assert len(out) == 3, out  # the two estimates and the warning; no log line
    assert re.fullmatch(r"\[alibi\] training will take about \S+ more \(8 steps at \d+\.\d\d s/step\)", out[0])
    assert re.fullmatch(r"\[alibi\] L=64: scoring 16 windows will take about \S+ \(from the first batch\); "
                        r"an interrupt loses only this length", out[1])
    assert out[2] == "a warning"


def test_windows_logged_until_the_length_is_scored(capsys, monkeypatch):
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)
    ui = progress.Progress(True, bars=False)
    ui(LengthStarted("t5", 32))
    for done in (2, 4, 6, 8):
        ui(WindowsScored(done, 8))
    ui(LengthScored("t5", 32, "ppl 2.5"))
    ui(WindowsScored(2, 8))  # (a batch outside a length: nothing to show it against)
    out = lines(capsys)
    assert [e.split(",")[0] for e in out[:-1]] == [f"[t5] L=32: {n}/8 windows" for n in (2, 4, 6)]  # (not at the end)
    assert out[-1] == "[t5] L=32: ppl 2.5"


def test_bars_open_and_close_with_their_events(capsys):
    ui = progress.Progress(True, bars=True)
    ui(StudyStarted(2))
    ui(TrainStarted("rope", 3, 0))
    assert ui._training is not None and ui._training.bar is not None
    for step in (1, 2, 3):
        ui(StepDone("rope", step, 3, 1.0, 5.0))
    ui(TrainEnded("rope"))
    assert ui._training is None
    ui(ScoringStarted("rope", 2, 0))
    ui(LengthStarted("rope", 16))
    ui(WindowsScored(1, 4))
    assert ui._length is not None and ui._length.bar is not None and ui._length.bar.n == 1
    ui(ScoringEnded("rope"))  # (left early, as an interrupt leaves it: both bars closed)
    assert ui._length is None and ui._scoring is None
    ui(RunDone("rope"))
    assert ui.study.n == 1
    ui(StudyEnded())
    assert ui.study is None
    assert "study" in capsys.readouterr().err


def test_a_process_other_than_the_main_one_shows_nothing(capsys, monkeypatch):
    monkeypatch.setattr(progress, "LONG_S", 0.0)
    ui = progress.Progress(True, main=False)
    ui(TrainStarted("rope", 10, 0))
    for step in (1, 2, 3):
        ui(StepDone("rope", step, 10, 1.0, 5.0))
    ui(Warn("a warning"))
    assert capsys.readouterr().err == ""


def test_a_search_line_per_individual(capsys):
    progress.Progress(True, bars=False)(SearchScored(1, 2, 7, 3.14159, 2.5, 0.1234))
    progress.Progress(False)(SearchScored(1, 2, 8, 3.0, 2.5, 0.1))  # (--no-progress: none)
    assert lines(capsys) == ["[longrope search] generation 1/2 individual 7: ppl 3.142 (best 2.500), 0.12s"]
