"""posenc extend: a study's checkpoint extended equals the study's +ft row; DroPE, LongRoPE, resume."""

from __future__ import annotations

import json

import pytest
import torch

from posenc.cli import main
from posenc.errors import UsageError
from posenc.extend import extend as ex
from posenc.model.checkpoint import load_checkpoint
from posenc.study.config import StudyConfig
from posenc.study.events import StepDone
from posenc.study.longrope_search import SearchSettings
from posenc.study.run import run_experiment


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    text = tmp_path_factory.mktemp("data") / "corpus.txt"  # (a small file: the built-in corpus takes seconds to read)
    text.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(2000)))
    cfg = StudyConfig.from_preset("smoke", methods=["rope+yarn+ft", "rope+linear+ft"], steps=20, finetune_steps=6,
                                  data=str(text), eval_lengths=[32, 64], valid_bytes=1024, dim=16, depth=1, num_heads=2,
                                  checkpoint_every=4, batch_size=4)
    return out, run_experiment(cfg, out, progress=False)


def _eval(results: dict, row: str) -> dict[int, float]:
    return {e["length"]: e["perplexity"] for e in results["methods"][row]["eval"]}


@pytest.mark.parametrize("kind", ["yarn", "linear"])
def test_extend_of_a_study_checkpoint_equals_its_ft_row(study, kind, tmp_path):
    out, results = study
    code = main(["extend", str(out / "checkpoints" / "rope.safetensors"), "--out", str(tmp_path / "ext"),
                 "--scaling", kind, "--steps", "6", "--no-progress"])
    assert code == 0
    record = json.loads((tmp_path / "ext" / "extend.json").read_text())
    ours = {s["length"]: s["perplexity"] for s in record["scores"]["extended"]}
    assert ours == _eval(results, f"rope+{kind}+ft")  # the same numbers, exactly
    assert {s["length"]: s["perplexity"] for s in record["scores"]["base"]} == _eval(results, "rope")
    theirs = load_checkpoint(out / "checkpoints" / f"rope+{kind}+ft.safetensors")
    mine = load_checkpoint(tmp_path / "ext" / "model.safetensors")
    assert mine.config == theirs.config and mine.config.encoding_options["scaling"]["rope_type"] == kind
    for (name, a), (_, b) in zip(mine.state_dict().items(), theirs.state_dict().items()):
        assert torch.equal(a, b), name
    assert record["train"]["losses"] == results["methods"][f"rope+{kind}+ft"]["train"]["losses"]
    table = json.loads((tmp_path / "ext" / "table.json").read_text())
    assert [r["length"] for r in table["rows"]] == [32, 64]
    assert (tmp_path / "ext" / "table.csv").read_text().startswith("length,base_perplexity")


def test_extend_resumes_from_its_training_state(study, tmp_path):
    out, results = study
    cfg = ex.ExtendConfig(**{**ex.study_defaults(out / "checkpoints" / "rope.safetensors", None), "scaling": "yarn",
                             "steps": 6})
    seen = []

    def stop(event):
        if isinstance(event, StepDone):
            seen.append(event.step)
            if event.step == 5:
                raise KeyboardInterrupt

    import posenc.extend.extend as module

    original = module.train
    module.train = lambda *a, **k: original(*a, **{**k, "report": stop})
    try:
        with pytest.raises(KeyboardInterrupt):
            ex.extend(out / "checkpoints" / "rope.safetensors", tmp_path / "ext", cfg, progress=False)
    finally:
        module.train = original
    assert (tmp_path / "ext" / "state.pt").exists()  # the state of step 4 (checkpoint_every 4)
    with pytest.raises(UsageError, match="resume"):
        ex.extend(out / "checkpoints" / "rope.safetensors", tmp_path / "ext", cfg, progress=False)
    record = ex.extend(out / "checkpoints" / "rope.safetensors", tmp_path / "ext", cfg, resume=True, progress=False)
    assert {s["length"]: s["perplexity"] for s in record["scores"]["extended"]} == _eval(results, "rope+yarn+ft")


def test_drope_and_searched_longrope(study, tmp_path):
    out, _ = study
    ckpt = out / "checkpoints" / "rope.safetensors"
    base = ex.study_defaults(ckpt, None)
    record = ex.extend(ckpt, tmp_path / "drope", ex.ExtendConfig(**{**base, "scaling": "drope", "steps": 3}), progress=False)
    assert record["train"]["positions_dropped_at_step"] == 0
    assert load_checkpoint(tmp_path / "drope" / "model.safetensors").config.encoding == "nope"
    search = SearchSettings(train_length=32, target_length=64, sequences=2, population=4, generations=1, parents=2,
                               mutations=2, crossovers=1)
    record = ex.extend(ckpt, tmp_path / "lr", ex.ExtendConfig(**{**base, "scaling": "longrope", "steps": 2, "search": search}),
                       progress=False)
    block = load_checkpoint(tmp_path / "lr" / "model.safetensors").config.encoding_options["scaling"]
    assert block == record["search"]["block"] and block["rope_type"] == "longrope"


def test_bad_options_name_the_parameter(study, tmp_path):
    out, _ = study
    with pytest.raises(UsageError, match="length"):
        ex.ExtendConfig(scaling="yarn", length=32, steps=1, train_length=32)
    with pytest.raises(UsageError, match="scaling"):
        ex.ExtendConfig(scaling="xpos", length=64, steps=1, train_length=32)
    assert main(["extend", str(out / "results.json"), "--out", str(tmp_path / "x"), "--scaling", "yarn",
                 "--steps", "1", "--train-length", "32", "--length", "64"]) == 2


def test_extend_resumes_a_checkpoint_named_by_another_path_and_refuses_its_study_folder(study, tmp_path, monkeypatch):
    """A run started with an absolute path resumes with a relative one (issue 48, item 24); --out may not
    be the folder holding the checkpoint, e.g. its study's (item 25)."""
    out, _ = study
    checkpoint = out / "checkpoints" / "rope.safetensors"
    args = ["--scaling", "yarn", "--steps", "0", "--no-progress"]
    assert main(["extend", str(checkpoint), "--out", str(tmp_path / "ext"), *args]) == 0
    monkeypatch.chdir(out)
    assert main(["extend", "checkpoints/rope.safetensors", "--out", str(tmp_path / "ext"), *args, "--resume"]) == 0
    with pytest.raises(UsageError, match="out"):
        ex.extend(checkpoint, out, ex.ExtendConfig(**{**ex.study_defaults(checkpoint, None), "scaling": "yarn", "steps": 0}),
                  progress=False)
