"""A run's score at one length is a typed record (posenc.study.metrics) written as the evaluation row
that docs (posenc.study.results) promise and load_results accepts."""

from __future__ import annotations

import json

import pytest

from posenc.files import write_json
from posenc.study.metrics import LMScore, RecallScore
from posenc.study.results import SCHEMA, load_results


def test_lm_score_writes_the_documented_keys_in_order():
    s = LMScore(length=128, perplexity=4.5, ppl_low=4.4, ppl_high=4.6, bits_per_byte=2.17, loss=1.5, tokens=4096,
                windows=32, untrained=[], variant={"scaling": {"kind": "yarn"}}, time_s=1.25)
    assert list(s.to_json()) == ["length", "perplexity", "ppl_low", "ppl_high", "bits_per_byte", "loss", "tokens",
                                 "windows", "status", "untrained", "scaling", "time_s"]
    assert s.to_json()["status"] == "ok" and s.to_json()["scaling"] == {"kind": "yarn"}
    assert s.log_line() == "perplexity 4.500 [4.400, 4.600], 2.170 bits/byte"


def test_a_length_that_cannot_run_keeps_its_metrics_none_and_says_why():
    s = LMScore(length=256, status="cannot run past 64 positions", tokens=4096, time_s=0.0)
    out = s.to_json()
    assert out == {"length": 256, "perplexity": None, "bits_per_byte": None, "loss": None, "tokens": 4096,
                   "status": "cannot run past 64 positions", "time_s": 0.0}
    assert s.log_line() == "cannot run past 64 positions"
    r = RecallScore(length=256, status="cannot run past 64 positions")
    assert r.to_json() == {"length": 256, "accuracy": None, "status": "cannot run past 64 positions"}


def test_recall_score_names_its_far_class():
    far = {"accuracy": 0.5, "acc_low": 0.4, "acc_high": 0.6, "queries": 64, "distance_min": 40, "distance_max": 60}
    s = RecallScore(length=64, accuracy=0.75, acc_low=0.7, acc_high=0.8, distances={"far": far}, time_s=2.0)
    assert list(s.to_json()) == ["length", "accuracy", "acc_low", "acc_high", "distances", "status", "time_s"]
    assert s.log_line() == "accuracy 0.750 [0.700, 0.800], far 0.500 (distance 40-60)"


@pytest.mark.parametrize("score", [
    LMScore(length=64, perplexity=4.5, ppl_low=4.4, ppl_high=4.6, bits_per_byte=2.17, loss=1.5, tokens=64, windows=1,
            time_s=0.5),
    LMScore(length=128, status="cannot run past 64 positions", tokens=64, time_s=0.0),
])
def test_results_with_typed_rows_load_back(tmp_path, score):
    entry = {"status": "done", "seed": 0, "model": {}, "parameters": 1, "checkpoint": None,
             "train": {}, "eval": [score.to_json()]}
    results = {"schema": SCHEMA, "status": "done", "config": {"methods": ["nope"], "task": "lm", "train_length": 64,
                                                        "steps": 10, "batch_size": 2, "eval_lengths": [64, 128]}, "seed": 0,
               "corpus": {"sha256": "0"}, "methods": {"nope": entry}}
    write_json(tmp_path / "results.json", results)
    loaded = load_results(tmp_path)
    assert loaded is not None and loaded["methods"]["nope"]["eval"] == json.loads(json.dumps([score.to_json()]))
