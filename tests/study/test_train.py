"""study/train.py and study/evaluation.py report their progress as events (study/events.py): the
loop's start, every step with its loss, its end however it is left; every batch of windows scored."""

from __future__ import annotations

import pytest
import torch

from posenc.model.lm import LM, LMConfig
from posenc.study import distributed, evaluation
from posenc.study.data import train_batch
from posenc.study.events import StepDone, TrainEnded, TrainStarted, WindowsScored
from posenc.study.train import TrainSettings, train

SETTINGS = TrainSettings(steps=4, lr=1e-3, warmup=1, min_lr_ratio=0.1, weight_decay=0.0, grad_clip=1.0,
                         checkpoint_every=2, batch_size=2, length=16, data_seed=0)
TEXT = torch.tensor(list(b"def f(x):\n    return x + 1\n" * 40), dtype=torch.uint8)


def model() -> LM:
    torch.manual_seed(0)
    return LM(LMConfig(encoding="alibi", dim=16, depth=1, num_heads=2))


def batches(step: int) -> tuple[torch.Tensor, ...]:
    return train_batch(TEXT, 0, step, 2, 16)


def test_the_loop_reports_its_start_every_step_and_its_end(tmp_path):
    events: list = []
    _, record = train("alibi", SETTINGS, model(), batches, tmp_path / "state.pt", distributed.Context(torch.device("cpu")),
                      events.append)
    assert events[0] == TrainStarted("alibi", 4, 0) and events[-1] == TrainEnded("alibi")
    steps = events[1:-1]
    assert [(e.label, e.step, e.steps) for e in steps] == [("alibi", k, 4) for k in (1, 2, 3, 4)]
    assert all(isinstance(e, StepDone) and e.tokens_per_s > 0 for e in steps)
    assert [round(e.loss, 5) for e in steps] == record.losses  # the loss reported is the one recorded


def test_an_interrupt_raised_by_the_report_still_ends_the_loop_and_resumes(tmp_path):
    events: list = []

    def stop(event):
        events.append(event)
        if isinstance(event, StepDone) and event.step == 3:
            raise KeyboardInterrupt

    ctx = distributed.Context(torch.device("cpu"))
    with pytest.raises(KeyboardInterrupt):
        train("alibi", SETTINGS, model(), batches, tmp_path / "state.pt", ctx, stop)
    assert events[-1] == TrainEnded("alibi")  # (a bar is closed however the loop is left)
    resumed: list = []
    train("alibi", SETTINGS, model(), batches, tmp_path / "state.pt", ctx, resumed.append)
    assert resumed[0] == TrainStarted("alibi", 4, 2)  # from the state of step 2 (checkpoint_every 2)


def test_evaluation_reports_every_batch_of_windows(monkeypatch):
    events: list = []
    monkeypatch.setattr(evaluation, "EVAL_TOKENS", 32)  # two windows of 16 per batch
    evaluation.evaluate(model(), TEXT[: 16 * 6 + 1], 16, None, distributed.Context(torch.device("cpu")), events.append)
    assert events == [WindowsScored(2, 6), WindowsScored(4, 6), WindowsScored(6, 6)]
