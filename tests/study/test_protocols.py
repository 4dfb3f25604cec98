"""The study's newer rows follow their papers' protocols: DroPE's recalibration (its own warmup and
cosine schedule, no weight decay) and randomized positions at evaluation as in training."""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc.study import StudyConfig, rows, run_experiment
from posenc.study import train as train_mod
from posenc.study.config import RANDOM_SPAN
from posenc.study.evaluation import eval_positions
from posenc.study.models import lm_config


def test_drope_recalibration_restarts_the_schedule():
    steps, drop_at, warmup, low = 1000, 880, 100, 0.1
    f = train_mod.drope_schedule(steps, drop_at, warmup, low)
    main = [f(s) for s in range(drop_at)]
    recal = [f(s) for s in range(drop_at, steps)]
    assert max(main) == pytest.approx(1.0) and main[-1] == pytest.approx(low, abs=0.01)  # pretraining completes its cosine
    assert recal[0] < 1.0 and max(recal) == pytest.approx(1.0)  # a fresh warmup to the peak
    assert recal[-1] == pytest.approx(low, abs=0.02)  # and its own decay
    assert all(math.isfinite(x) and x > 0 for x in main + recal)


def test_a_drop_row_recalibrates_at_the_peak_learning_rate_without_weight_decay(tmp_path, monkeypatch):
    seen = {}
    make = train_mod.make_optimizer

    def spy(model, settings):
        opt, sched = make(model, settings)
        seen["opt"], seen["lrs"] = opt, []
        step = opt.step

        def record(*a, **k):
            seen["lrs"].append((opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"]))
            return step(*a, **k)

        opt.step = record
        return opt, sched

    monkeypatch.setattr(train_mod, "make_optimizer", spy)
    cfg = StudyConfig(methods=["rope+drop"], steps=20, batch_size=2, train_length=16, eval_lengths=[16], dim=16, depth=1,
                      num_heads=2, valid_bytes=64, checkpoint_every=100, lr=1e-3, weight_decay=0.1)
    run_experiment(cfg, tmp_path / "run", progress=False)
    lrs = seen["lrs"]
    drop = cfg.drop_step
    assert all(wd == 0.1 for _, wd in lrs[:drop]) and all(wd == 0.0 for _, wd in lrs[drop:])
    assert lrs[drop - 1][0] == pytest.approx(cfg.lr * cfg.min_lr_ratio, rel=0.2)  # the main schedule ended
    assert max(lr for lr, _ in lrs[drop:]) == pytest.approx(cfg.lr)  # the recalibration reached the peak again


def test_random_rows_are_evaluated_at_random_positions_drawn_as_in_training():
    model = posenc.LM(posenc.LMConfig(encoding="rope", dim=16, depth=1, num_heads=2, random_positions=400))
    a = eval_positions(model, 50, 0, "cpu")
    assert a.shape == (50,) and torch.all(a[1:] > a[:-1]) and int(a.max()) < 400
    assert torch.equal(a, eval_positions(model, 50, 0, "cpu"))  # the same draw every run
    assert not torch.equal(a, eval_positions(model, 50, 1, "cpu"))  # another batch, another draw
    plain = posenc.LM(posenc.LMConfig(encoding="rope", dim=16, depth=1, num_heads=2))
    assert eval_positions(plain, 50, 0, "cpu") is None


def test_random_rows_draw_from_four_times_the_longest_evaluation_length():
    cfg = StudyConfig(methods=["rope+random"], eval_lengths=[64, 256])
    assert lm_config(cfg, rows.parse("rope+random")).random_positions == RANDOM_SPAN * 256 == 1024
