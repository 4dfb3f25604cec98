"""The extend preset: its rows and sizes, and a smoke-sized run of both halves."""

from __future__ import annotations

import pytest

from posenc.study.config import COMPANIONS, EXTEND, PRESETS, StudyConfig
from posenc.study.plan import check
from posenc.study.rows import SEARCHED
from posenc.study.run import run_experiment

SMOKE = dict(dim=16, depth=1, num_heads=2, train_length=16, eval_lengths=[16, 32], steps=10, finetune_steps=2,
             finetune_length=32, batch_size=4, checkpoint_every=5, seeds=1)


def test_the_preset_is_the_issue_experiment():
    lm, recall = PRESETS["extend"], PRESETS[COMPANIONS["extend"]]
    assert lm["train_length"] == 64 and lm["finetune_length"] == 256 and lm["seeds"] == 3
    assert lm["finetune_steps"] == round(0.05 * lm["steps"]) and recall["finetune_steps"] == round(0.05 * recall["steps"])
    assert lm["eval_lengths"][0] == 64 and lm["eval_lengths"][-1] == 2048 and recall["task"] == "recall"
    cfg = StudyConfig.from_preset("extend")
    for scaling in ("linear", "ntk", "yarn", "llama3", "longrope"):  # each zero-shot and fine-tuned
        assert f"rope+{scaling}" in cfg.methods and f"rope+{scaling}+ft" in cfg.methods
    assert {"rope+longrope_searched+ft", "rope+drop@88", "rope+drop@70", "rope+drop@50", "alibi", "nope"} <= set(cfg.methods)
    check(cfg)  # every row builds at full size (meta device) and takes its variant at every length


@pytest.mark.parametrize("preset", ["extend", "extend-recall"])
def test_smoke_sized_run(preset, tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400)))
    extra = {"valid_bytes": 512, "data": str(text)} if preset == "extend" else {"recall_sequences": 2, "train_length": 32,
                                                              "eval_lengths": [32, 64], "finetune_length": 64}
    cfg = StudyConfig.from_preset(preset, **{**SMOKE, **extra})
    results = run_experiment(cfg, tmp_path / preset, progress=False)
    rows = [r for r in EXTEND if preset == "extend" or SEARCHED not in r]
    scalings = [r for r in rows if "drop" not in r and r.startswith("rope+")]
    assert set(cfg.methods) == {*rows, "rope", *(f"{r}+ft" for r in scalings)} == set(results["methods"])
    assert all(entry["status"] == "done" for entry in results["methods"].values())
    for percent in (88, 70, 50):  # DroPE after 88%, 70% and 50% of the 10 steps
        train = results["methods"][f"rope+drop@{percent}"]["train"]
        assert train["positions_dropped_at_step"] == round(percent / 10)
    if preset == "extend":  # the searched rows: the search's block at 32, the plain rotation at 16
        evals = {e["length"]: e["scaling"] for e in results["methods"]["rope+longrope_searched"]["eval"]}
        assert evals[16]["long_factor"] == [1.0] * 4 and evals[32]["rope_type"] == "longrope"
        assert evals[32]["long_factor"] != results["methods"]["rope+longrope"]["eval"][1]["scaling"]["long_factor"]
        assert (tmp_path / preset / "state" / "rope.search-L32.json").exists()
