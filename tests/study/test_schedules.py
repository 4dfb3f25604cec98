"""Schedule rows in ``posenc study`` and the ``schedules`` preset (issue 19, item 6).

A row written in the schedule's text form trains a model whose layers follow it (checked on the
trained model itself), its label is the text, its files have safe names; a wrong text is a
UsageError naming the row; the ``schedules`` preset runs the language-model study and then the
recall study of the same rows from one command. Smoke sizes: the numbers mean nothing here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import posenc
from posenc import cli
from posenc.encodings.rope import RoPE
from posenc.errors import UsageError
from posenc.study import rows, variants
from posenc.study.cli import config_from_args, run_study
from posenc.study.config import COMPANIONS, PRESETS, SCHEDULES, StudyConfig
from posenc.study.models import lm_config
from posenc.study.plan import check

LOCAL_GLOBAL = "3x[rope:base=1e4 window=32] 1x[rope:base=1e6]"
TEMPERATURE = "3x[rope] 1x[nope temp=0.1/16]"
TINY = ["--dim", "32", "--num-heads", "2", "--steps", "3", "--batch-size", "4", "--checkpoint-every", "2",
        "--eval-lengths", "64", "128", "--valid-bytes", "1024", "--recall-sequences", "4", "--seeds", "1",
        "--threads", "1", "--quiet"]


def study(out: Path, *argv: str) -> int:
    return run_study(cli.build_parser().parse_args(["study", "--preset", "schedules", *TINY, *argv, "--out", str(out)]))


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("schedules") / "run"
    assert study(out) == 0
    return out


# ------------------------------------------------------------------ the rows


def test_the_preset_asks_the_issues_question_at_the_default_sizes():
    lm, recall = PRESETS["schedules"], PRESETS[COMPANIONS["schedules"]]
    assert lm["methods"] == recall["methods"] == SCHEDULES
    assert {"rope", "alibi", "nope", "3x[rope] 1x[nope]", TEMPERATURE, "[rope window=32]", LOCAL_GLOBAL} <= set(SCHEDULES)
    assert lm["task"] == "lm" and recall["task"] == "recall"
    for preset in (lm, recall):
        assert preset["depth"] == 4 and preset["train_length"] == 64 and preset["eval_lengths"][-1] == 1024
        assert preset["seeds"] == 3 and preset["dim"] == PRESETS["default"]["dim"]
    assert {k: lm[k] for k in ("steps", "lr", "batch_size")} == {k: PRESETS["default"][k] for k in ("steps", "lr", "batch_size")}
    assert {k: recall[k] for k in ("steps", "lr")} == {k: PRESETS["recall"][k] for k in ("steps", "lr")}
    for name in ("schedules", "schedules-recall"):  # every row builds at full size (meta device)
        cfg = check(StudyConfig.from_preset(name))
        assert cfg.methods == SCHEDULES and cfg.seeds == 3


def test_a_window_and_a_temperature_that_mean_something_at_length_64():
    """The window is shorter than the training length; the temperature varies inside training and
    keeps growing past it (Llama 4's formula written out)."""
    cfg = StudyConfig.from_preset("schedules")
    windowed = lm_config(cfg, rows.parse("[rope window=32]")).layers
    assert {layer.window for layer in windowed.layers} == {32} and 32 < cfg.train_length
    scale = lm_config(cfg, rows.parse(TEMPERATURE)).layers.layers[3].query_scale
    pos = torch.tensor([0, 14, 15, 63, 1023])
    expected = [1 + 0.1 * math.log1p(math.floor((p + 1) / 16)) for p in pos.tolist()]
    assert torch.allclose(scale.factor(pos), torch.tensor(expected, dtype=torch.float64), atol=1e-12)
    assert expected[1] == 1.0 and 1.1 < expected[3] < 1.2 and expected[4] > 1.4


def test_schedule_rows_parse_through_the_schedule_reader():
    row = rows.parse(LOCAL_GLOBAL)
    assert row.kind == "train" and row.schedule == LOCAL_GLOBAL and row.name == LOCAL_GLOBAL and row.base is None
    assert rows.fair_schedule(row, 64, 4) == posenc.Schedule.parse(LOCAL_GLOBAL, 4).to_list()
    variant = rows.parse(LOCAL_GLOBAL + "+yarn")
    assert variant.kind == "eval" and variant.base == LOCAL_GLOBAL and variant.eval == "yarn"
    assert rows.parse("[rope:base=1e+4 window=32]+random").train == ("random",)  # a '+' inside the text is not a variant
    assert rows.parse("[rope:base=1e+4 window=32]+yarn").base == "[rope:base=1e+4 window=32]"
    for name in SCHEDULES:
        stem = rows.parse(name).stem
        assert all(c.isalnum() or c in "._()+-" for c in stem), stem
    assert rows.parse(TEMPERATURE).stem == "3x(rope)_1x(nope_temp-0.1_16)"
    # the fair-table rule acts on each layer: T5's max_distance capped where the layer does not set it
    layers = rows.fair_schedule(rows.parse("1x[t5 window=32] 1x[t5:max_distance=128]"), 64, 2)
    assert [layer["options"]["max_distance"] for layer in layers] == [64, 128]


@pytest.mark.parametrize("name, message", [
    ("3x[rope windw=32] 1x[nope]", "no option"),
    ("3x[rope] 1x[nope]x", "variants"),
    ("3x[rope]] 1x[nope]", "cannot read"),
    ("[rope window=0]", "window"),
    ("[learned]", "absolute method"),
    ("3x[nope] 1x[alibi]+yarn", "RoPE scaling"),
    ("3x[rope] 1x[nope]+blockwise", "block_size"),
    ("3x[rope] 1x[nope]+fast", "variant"),
    ("5x[rope] 1x[nope]", "more than depth=4"),
])
def test_a_wrong_schedule_row_is_a_usage_error_naming_it(name, message):
    with pytest.raises(UsageError, match=message) as info:
        check(StudyConfig.from_preset("schedules", methods=[name]))
    assert f"methods: {name!r}" in str(info.value)


def test_schedule_rows_have_fixed_colours_in_their_first_layers_family():
    from matplotlib.colors import to_rgb

    from posenc.study.figures import COLORS, color

    got = {name: color(name) for name in SCHEDULES}
    assert all(c is not None for c in got.values()) and got == {name: color(name) for name in SCHEDULES}
    assert got["rope"] == COLORS["rope"] and got["3x[rope] 1x[nope]"] != COLORS["rope"]
    assert color(LOCAL_GLOBAL + "+yarn") not in (got[LOCAL_GLOBAL], None)
    r, g, b = to_rgb(got[LOCAL_GLOBAL])
    assert r > b  # an orange of rope's family, not a blue


def test_rows_that_would_share_files_are_refused():
    with pytest.raises(UsageError, match="share the file name"):
        check(StudyConfig.from_preset("schedules", methods=["3x[rope] 1x[nope]", "3x[rope]\t1x[nope]"]))


def test_a_scaling_acts_on_the_rope_layers_each_from_its_own_base():
    cfg = StudyConfig.from_preset("schedules", dim=32, num_heads=2, methods=[LOCAL_GLOBAL, "3x[rope] 1x[nope]"])
    model = posenc.LM(lm_config(cfg, rows.parse(LOCAL_GLOBAL)))
    encs = variants.encodings(model)
    assert [e.base for e in encs] == [1e4, 1e6]
    plain = [e.scaling for e in encs]
    with variants.applied(model, rows.parse(LOCAL_GLOBAL + "+longrope"), 256, 64) as applied:
        assert all(e.scaling != p for e, p in zip(encs, plain))
        blocks = applied["scaling"]
        assert blocks == [variants.scaling_block("longrope", 4.0, 64, e.base, e.rotary_dim) for e in encs]
        assert sum(blocks[1]["long_factor"]) > sum(blocks[0]["long_factor"])  # base 1e6: more pairs never turn in 64
    assert [e.scaling for e in encs] == plain
    model = posenc.LM(lm_config(cfg, rows.parse("3x[rope] 1x[nope]")))
    rope = model.blocks[0].attn.encoding
    plain = rope.scaling
    with variants.applied(model, rows.parse("3x[rope] 1x[nope]+linear"), 256, 64) as applied:
        assert applied["scaling"] == {"rope_type": "linear", "factor": 4.0}
        assert rope.scaling != plain and rope.scaling.rope_type == "linear"
        assert not isinstance(model.blocks[3].attn.encoding, RoPE)
    assert rope.scaling == plain


def test_a_fine_tuned_schedule_row_scales_every_rope_layer():
    cfg = check(StudyConfig.from_preset("schedules", dim=32, num_heads=2, finetune_steps=2,
                                        methods=["3x[rope] 1x[nope]+yarn+ft"]))
    layers = lm_config(cfg, rows.parse("3x[rope] 1x[nope]+yarn+ft")).schedule
    assert [layer.get("options", {}).get("scaling", {}).get("factor") for layer in layers] == [2.0, 2.0, 2.0, None]


def test_task_recall_with_the_schedules_preset_is_its_recall_half():
    args = cli.build_parser().parse_args(["study", "--preset", "schedules", "--task", "recall"])
    cfg = config_from_args(args)
    assert cfg.preset == "schedules-recall" and cfg.task == "recall" and cfg.steps == PRESETS["schedules-recall"]["steps"]


# ------------------------------------------------------------------ one command, both tasks


def test_one_command_trains_and_evaluates_every_row_for_both_tasks(pair):
    for part, key in (("lm", "perplexity"), ("recall", "accuracy")):
        res = json.loads((pair / part / "results.json").read_text())
        assert res["status"] == "done" and res["config"]["task"] == part and res["wall_s"] > 0
        assert list(res["methods"]) == SCHEDULES
        for name, entry in res["methods"].items():
            assert entry["status"] == "done", name
            assert [e["length"] for e in entry["eval"]] == [64, 128]
            assert all(e["status"] == "ok" and math.isfinite(e[key]) for e in entry["eval"]), (name, entry["eval"])
        assert res["methods"][LOCAL_GLOBAL]["row"]["schedule"] == LOCAL_GLOBAL
        table = (pair / part / "results.md").read_text()
        assert all(f"| {name} |" in table for name in SCHEDULES)  # the label is the row as written
    assert (pair / "report.html").stat().st_size > 0
    page = (pair / "report.html").read_text()
    assert TEMPERATURE in page and "recall" in page.lower()


def test_the_trained_schedule_rows_have_their_layer_kinds(pair):
    def loaded(name: str) -> posenc.LM:
        return posenc.load_checkpoint(pair / "lm" / "checkpoints" / f"{rows.parse(name).stem}.safetensors")

    model = loaded(LOCAL_GLOBAL)
    attns = [b.attn for b in model.blocks]
    assert [a.window for a in attns] == [32, 32, 32, None]
    assert [a.encoding.base for a in attns] == [1e4, 1e4, 1e4, 1e6]
    assert attns[0].encoding is attns[1].encoding is attns[2].encoding and attns[3].encoding is not attns[0].encoding
    model = loaded(TEMPERATURE)
    attns = [b.attn for b in model.blocks]
    assert [isinstance(a.encoding, RoPE) for a in attns] == [True, True, True, False]
    assert attns[3].encoding.name == "nope" and attns[3].query_scale is not None
    assert all(a.query_scale is None and a.window is None for a in attns[:3])
    model = loaded("[rope window=32]")
    assert [b.attn.window for b in model.blocks] == [32] * 4
    plain = loaded("rope")
    assert plain.config.schedule is None and all(b.attn.window is None for b in plain.blocks)


def test_the_pair_resumes_as_one(pair, capsys):
    before = {part: json.loads((pair / part / "results.json").read_text())["methods"] for part in ("lm", "recall")}
    assert run_study(cli.build_parser().parse_args(["study", "--resume", "--quiet", "--out", str(pair)])) == 0
    after = {part: json.loads((pair / part / "results.json").read_text())["methods"] for part in ("lm", "recall")}
    for part in ("lm", "recall"):  # every run skipped: the same numbers
        assert {m: e["eval"] for m, e in before[part].items()} == {m: e["eval"] for m, e in after[part].items()}
    assert "wall time of both" in capsys.readouterr().out


def test_resume_of_a_folder_with_no_study_is_refused(tmp_path):
    with pytest.raises(UsageError, match="holds no study"):
        study(tmp_path / "none", "--resume")


def test_a_schedule_row_is_refused_on_a_transformers_architecture(tmp_path):
    with pytest.raises(UsageError, match=r"methods: '3x\[rope\] 1x\[nope\]' is a layer schedule"):
        check(StudyConfig.from_preset("schedules", methods=["rope", "3x[rope] 1x[nope]"],
                                      hf_config=str(tmp_path / "config.json")))
