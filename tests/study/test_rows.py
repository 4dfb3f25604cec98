"""``posenc study`` rows beyond one method at one seed: several seeds (and resuming one), RoPE
scalings and blockwise xPos evaluated without training, fine-tuned scalings, positions dropped late,
the fair-table rule and the untrained-parameter check, the recall task, two runs side by side."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch

import posenc
from posenc import cli
from posenc.encodings.rope import RoPE
from posenc.model.lm import LMConfig
from posenc.study import fairness, report, rows
from posenc.study.cli import run_study
from posenc.study.config import StudyConfig
from posenc.study.distributed import Context
from posenc.study.plan import check

SMALL = ["--preset", "smoke", "--valid-bytes", "512", "--eval-lengths", "32", "64", "--quiet", "--threads", "1"]


def study(out: Path, *argv: str, on_step=None) -> int:
    return run_study(cli.build_parser().parse_args(["study", *SMALL, *argv, "--out", str(out)]), on_step=on_step)


def load(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def numbers(out: Path) -> dict:
    """Per row and seed: loss curve and evaluation; and the across-seed rows."""
    res = load(out)
    got = {}
    for m, e in res["methods"].items():
        for run in [e, *e.get("seeds", [])]:
            got[(m, run["seed"])] = (run["train"].get("losses"), [(r["length"], r["loss"]) for r in run["eval"]])
        across = e.get("across_seeds")
        if across:  # (not the timings)
            got[(m, "across")] = (across["seeds"], across["eval"], across["train"]["losses"], across["train"]["final_loss"])
    return got


# ------------------------------------------------------------------ seeds


SEEDS = ["--methods", "alibi", "--steps", "6", "--checkpoint-every", "2", "--seeds", "3"]


@pytest.fixture(scope="module")
def three_seeds(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("seeds") / "run"
    assert study(out, *SEEDS) == 0
    return out


def test_three_seeds_report_the_mean_and_the_spread(three_seeds):
    res = load(three_seeds)
    e = res["methods"]["alibi"]
    assert e["seed"] == 0 and [r["seed"] for r in e["seeds"]] == [1, 2]
    assert (three_seeds / "checkpoints" / "alibi.safetensors").is_file()
    for s in (1, 2):
        assert (three_seeds / "checkpoints" / f"alibi.seed{s}.safetensors").is_file()
    across = e["across_seeds"]
    assert across["seeds"] == [0, 1, 2] and across["train"]["seeds"] == 3
    per_seed = {r["seed"]: r for r in [e, *e["seeds"]]}
    losses = [per_seed[s]["train"]["losses"] for s in (0, 1, 2)]
    assert losses[0] != losses[1]  # other initial weights and data order
    for row in across["eval"]:
        seeds_rows = [next(x for x in per_seed[s]["eval"] if x["length"] == row["length"]) for s in (0, 1, 2)]
        assert row["loss"] == pytest.approx(sum(x["loss"] for x in seeds_rows) / 3)
        assert row["perplexity"] == pytest.approx(math.exp(row["loss"]))
        assert row["seed_values"] == [x["perplexity"] for x in seeds_rows]
        assert row["seed_min"] <= row["perplexity"] <= row["seed_max"]
        assert row["seed_sd"] == pytest.approx(torch.tensor(row["seed_values"]).std().item(), rel=1e-6)
        assert row["ppl_low"] < row["perplexity"] < row["ppl_high"]
    with open(three_seeds / "results.csv", newline="") as f:
        lines = list(csv.DictReader(f))
    assert [int(x["seeds"]) for x in lines] == [3, 3] and all(float(x["seed_sd"]) > 0 for x in lines)


def test_a_kill_in_the_third_seed_resumes_there(tmp_path, three_seeds):
    out = tmp_path / "run"
    # one seed first, then more seeds asked for on resume, interrupted in the third
    assert study(out, *SEEDS[:-2], "--seeds", "1") == 0
    assert "seeds" not in load(out)["methods"]["alibi"]

    def stop(label, step):
        if label == "alibi seed 2" and step == 3:
            raise KeyboardInterrupt

    assert study(out, *SEEDS, "--resume", on_step=stop) == 130
    partial = load(out)["methods"]["alibi"]
    assert [r["status"] for r in partial["seeds"]] == ["done"]  # seed 1 done, seed 2 not yet recorded
    assert torch.load(out / "state" / "alibi.seed2.pt", weights_only=True)["step"] == 2
    stepped = []
    assert study(out, *SEEDS, "--resume", on_step=lambda label, step: stepped.append((label, step))) == 0
    assert stepped == [("alibi seed 2", k) for k in range(3, 7)]  # seeds 0 and 1 skipped
    assert numbers(out) == numbers(three_seeds)
    assert load(out)["config"]["seeds"] == 3


# ------------------------------------------------------------------ rows evaluated or fine-tuned


ROWS = ["--methods", "rope", *[f"rope+{s}" for s in rows.SCALINGS], "xpos", "xpos+blockwise",
        "--steps", "4", "--eval-lengths", "32", "64", "128", "--finetune-steps", "2"]


@pytest.fixture(scope="module")
def variant_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("rows") / "run"
    trained = []
    assert study(out, *ROWS, on_step=lambda label, step: trained.append(label)) == 0
    return out, load(out), trained


def test_rope_scalings_are_rows_of_the_trained_rope_model(variant_run):
    out, res, trained = variant_run
    ft = [f"rope+{s}+ft" for s in rows.SCALINGS]
    assert sorted(set(trained)) == sorted(["rope", "xpos", *ft])  # the scalings trained nothing
    assert list(res["methods"]) == ["rope", *[x for s in rows.SCALINGS for x in (f"rope+{s}", f"rope+{s}+ft")],
                                    "xpos", "xpos+blockwise"]
    rope = {r["length"]: r for r in res["methods"]["rope"]["eval"]}
    for s in rows.SCALINGS:
        e = res["methods"][f"rope+{s}"]
        assert e["row"] == {"method": "rope", "kind": "eval", "options": {}, "variant": s, "base": "rope"}
        assert e["checkpoint"] == res["methods"]["rope"]["checkpoint"] and e["train"] == {}
        by = {r["length"]: r for r in e["eval"]}
        assert by[32]["loss"] == pytest.approx(rope[32]["loss"], rel=1e-6)  # every scaling is RoPE at 1x
        assert by[32]["ppl_low"] == pytest.approx(rope[32]["ppl_low"], rel=1e-6)
        for n in (64, 128):
            block = by[n]["scaling"]
            assert block["rope_type"] == s
            if s == "dynamic":
                assert block["factor"] == 1.0 and block["original_max_position_embeddings"] == 32
            else:
                assert block["factor"] == n / 32
            if s == "longrope":
                assert block["short_factor"] == [1.0] * 8 and set(block["long_factor"]) == {1.0, n / 32}
        assert by[128]["loss"] != rope[128]["loss"]  # (a 4-step model barely uses positions: any change)
    # the trained RoPE model is unchanged by its variants
    model = posenc.load_checkpoint(out / res["methods"]["rope"]["checkpoint"])
    assert model.encoding.scaling.rope_type == "default"


def test_fine_tuned_scalings_start_from_rope_and_keep_their_scaling(variant_run):
    out, res, _ = variant_run
    e = res["methods"]["rope+yarn+ft"]
    assert e["row"]["kind"] == "finetune" and e["row"]["finetune"] == {"steps": 2, "length": 64}
    assert e["train"]["steps"] == 2 and e["train"]["from"] == "rope" and e["train"]["tokens"] == 2 * 8 * 32
    model = posenc.load_checkpoint(out / e["checkpoint"])
    assert model.config.encoding_options["scaling"]["rope_type"] == "yarn"
    assert model.config.encoding_options["scaling"]["factor"] == 2.0  # finetune_length / train_length
    assert model.encoding.scaling.rope_type == "yarn"
    rope = posenc.load_checkpoint(out / res["methods"]["rope"]["checkpoint"])
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), rope.state_dict().values()))


def test_xpos_is_evaluated_with_and_without_blockwise_attention(variant_run):
    _, res, _ = variant_run
    plain = {r["length"]: r for r in res["methods"]["xpos"]["eval"]}
    block = {r["length"]: r for r in res["methods"]["xpos+blockwise"]["eval"]}
    assert all(r["block_size"] == 16 for r in block.values())  # half the training length
    assert block[32]["loss"] == pytest.approx(plain[32]["loss"], rel=1e-5)  # two blocks cover 32 positions
    assert block[128]["loss"] != pytest.approx(plain[128]["loss"], rel=1e-4)


def test_rows_that_cannot_apply_are_usage_errors():
    for name, message in (("alibi+yarn", "alibi is not a RoPE encoding"), ("rope+blockwise", "block_size option"),
                          ("rope+drop+yarn", "no positions left"), ("t5:nosuch=1", "no option 'nosuch'"),
                          ("rope+yarn+drop", "misplaced variant 'drop'"), ("rope+ft", "misplaced variant 'ft'")):
        with pytest.raises(posenc.UsageError, match=name.replace("+", r"\+") + ".*" + message):
            rows.parse(name)
    for extra, message in ((dict(drop_positions_after=0.2), "drop_positions_after applies to METHOD\\+drop rows"),
                           (dict(methods=["rope+yarn+ft"]), "give finetune_steps"),
                           (dict(methods=["rope+drop"], drop_positions_after=1.5), "fraction in \\(0, 1\\)"),
                           (dict(finetune_steps=3), "finetune_steps fine-tunes the rope scaling rows")):
        with pytest.raises(posenc.UsageError, match=message):
            check(StudyConfig.from_preset("smoke", **{"methods": ["rope"], **extra}))
    assert rows.expand(["rope+yarn+ft"], True) == ["rope", "rope+yarn", "rope+yarn+ft"]
    # the task alone picks its preset's sizes and rows
    from posenc.study.cli import config_from_args

    cfg = config_from_args(cli.build_parser().parse_args(["study", "--task", "recall"]))
    assert cfg.preset == "recall" and cfg.task == "recall" and cfg.methods == StudyConfig.from_preset("recall").methods


def test_a_rows_base_and_variant_are_typed_accessors():
    """Row.parent / Row.variant (and plan.Run.parent): the parsed base row and the evaluation variant
    of an evaluated or fine-tuned row; a UsageError for a trained row, never a None used later."""
    ft = rows.parse("rope+yarn+ft")
    assert (ft.kind, ft.parent.name, ft.variant, ft.base, ft.trained) == ("finetune", "rope", "yarn", "rope", ft)
    evaluated = rows.parse("rope+yarn")
    assert (evaluated.kind, evaluated.parent.name, evaluated.variant, evaluated.trained.name) == ("eval", "rope", "yarn", "rope")
    for attribute, message in (("parent", "no parsed base row"), ("variant", "no evaluation variant")):
        with pytest.raises(posenc.UsageError, match=message):
            getattr(rows.parse("rope"), attribute)
    from posenc.study.plan import Run

    trained = Run(rows.parse("rope"), 0, 1, "rope", Path("rope.safetensors"), Path("rope.state"), None)
    assert Run(rows.parse("rope+yarn"), 0, 1, "rope+yarn", trained.checkpoint, trained.state, None, trained).parent is trained
    with pytest.raises(posenc.UsageError, match="no base run"):
        trained.parent
    # a Models method given another kind's model (a programming error) says so
    from posenc.errors import as_kind

    model = posenc.LM(LMConfig(dim=16, depth=1, num_heads=2))
    assert as_kind(model, posenc.LM) is model
    with pytest.raises(TypeError, match="expected a Linear"):
        as_kind(model, torch.nn.Linear)


# ------------------------------------------------------------------ positions dropped late


def test_drop_positions_removes_the_hooks_for_the_last_steps(tmp_path, monkeypatch):
    calls = []
    original = RoPE.rotate

    def counting(self, *args):
        calls.append(1)
        return original(self, *args)

    monkeypatch.setattr(RoPE, "rotate", counting)
    per_step = {}

    def record(label, step):
        per_step[step] = len(calls)
        calls.clear()

    args = ["--methods", "rope+drop", "--steps", "8", "--checkpoint-every", "2", "--drop-positions-after", "0.25"]
    assert study(tmp_path / "ref", *args, on_step=record) == 0
    assert [per_step[s] > 0 for s in range(1, 9)] == [True] * 6 + [False] * 2  # steps 7 and 8 without
    res = load(tmp_path / "ref")
    e = res["methods"]["rope+drop"]
    assert e["train"]["positions_dropped_at_step"] == 6 and e["row"]["positions_dropped_after"] == 0.25
    assert e["model"]["encoding"] == "nope"
    model = posenc.load_checkpoint(tmp_path / "ref" / e["checkpoint"])  # a NoPE model with rope's training
    assert model.config.encoding == "nope"
    from posenc.study.data import load_corpus
    from posenc.study.evaluation import evaluate

    again = evaluate(model, load_corpus("default", 512).valid, 32, None, Context(torch.device("cpu")))
    assert again["loss"] == pytest.approx(e["eval"][0]["loss"], rel=1e-6)

    # interrupted after the drop, resumed: the same numbers (the state holds the model without positions)
    def stop(label, step):
        if step == 7:
            raise KeyboardInterrupt

    # t5: its table leaves the model at the drop, so a state after the drop has other tensors
    args = ["--methods", "t5+drop", "--steps", "8", "--checkpoint-every", "1", "--drop-positions-after", "0.25"]
    assert study(tmp_path / "t5ref", *args) == 0
    out = tmp_path / "run"
    assert study(out, *args, on_step=stop) == 130
    state = torch.load(out / "state" / "t5+drop.pt", weights_only=True)
    assert state["step"] == 7 and not any("relative_attention_bias" in k for k in state["model"])
    assert study(out, *args, "--resume") == 0
    assert numbers(out) == numbers(tmp_path / "t5ref")
    assert "encoding.relative_attention_bias.weight" not in posenc.load_checkpoint(
        out / "checkpoints" / "t5+drop.safetensors").state_dict()


def test_a_resume_naming_other_rows_keeps_the_drop_option_of_the_saved_rows(tmp_path, capsys):
    # drop_positions_after is checked against the study's rows, the saved ones too: a resume that
    # adds a row without +drop is not refused for the option its saved +drop row reads
    out = tmp_path / "run"
    args = ["--steps", "4", "--checkpoint-every", "2", "--drop-positions-after", "0.25"]
    assert study(out, "--methods", "rope+drop", *args) == 0
    before = load(out)["methods"]["rope+drop"]
    assert study(out, "--methods", "alibi", *args, "--resume") == 0
    res = load(out)
    assert list(res["methods"]) == ["rope+drop", "alibi"] and res["status"] == "done"
    assert res["config"]["drop_positions_after"] == 0.25
    assert res["methods"]["rope+drop"]["eval"] == before["eval"]  # the finished row was not run again
    assert res["methods"]["alibi"]["status"] == "done"
    # a new study with the option and no +drop row is still refused, before anything is written
    with pytest.raises(posenc.UsageError, match="drop_positions_after applies to METHOD\\+drop rows"):
        study(tmp_path / "new", "--methods", "alibi", *args)
    assert not (tmp_path / "new").exists()


# ------------------------------------------------------------------ fair position tables


def test_t5_buckets_beyond_the_training_length_are_reported_untrained(tmp_path):
    out = tmp_path / "run"
    assert study(out, "--methods", "t5", "t5:max_distance=128", "--train-length", "64", "--eval-lengths", "64", "128",
                 "--valid-bytes", "1024", "--steps", "4") == 0
    res = load(out)
    fair, paper = res["methods"]["t5"], res["methods"]["t5:max_distance=128"]
    assert fair["row"]["options"] == {"max_distance": 64} and fair["model"]["encoding_options"] == {"max_distance": 64}
    assert paper["row"]["options"] == {"max_distance": 128}
    assert [r["untrained"] for r in fair["eval"]] == [[], []]
    assert paper["eval"][0]["untrained"] == []  # at the training length every used bucket was trained
    assert paper["eval"][1]["untrained"] == [
        {"parameter": "encoding.relative_attention_bias.weight", "rows": "27-31", "count": 5, "of": 32}]
    assert (out / "checkpoints" / "t5_max_distance-128.safetensors").is_file()
    page = report.render(res, "t")
    assert "27-31" in page and "t5:max_distance=128" in page


def test_the_check_finds_untrained_rows_of_any_position_table():
    """A learned table of 128 rows of which training moved the first 64: the rows 64.. are used
    at length 128 untrained; Shaw's future rows are never used by a causal model."""
    torch.manual_seed(0)
    cfg = LMConfig(encoding="learned", dim=16, depth=1, num_heads=2, max_positions=128)
    initial, model = posenc.LM(cfg), posenc.LM(cfg)
    model.load_state_dict(initial.state_dict())
    with torch.no_grad():
        model.encoding.table[:64] += 0.1
    tokens = torch.randint(0, 256, (1, 129))
    assert fairness.untrained_used(model, initial, tokens) == [
        {"parameter": "encoding.table", "rows": "64-127", "count": 64, "of": 128}]
    assert fairness.untrained_used(model, initial, tokens[:, :65]) == []
    cfg = LMConfig(encoding="shaw", dim=16, depth=1, num_heads=2, encoding_options={"max_relative_position": 4})
    initial, model = posenc.LM(cfg), posenc.LM(cfg)
    model.load_state_dict(initial.state_dict())
    with torch.no_grad():
        for name, p in fairness.position_parameters(model).items():
            p[:5] += 0.1  # distances -4..0: the past and the present
    assert fairness.untrained_used(model, initial, tokens[:, :33]) == []  # rows 5..8 (the future) unused
    assert fairness.untrained_used(posenc.LM(LMConfig(encoding="rope", dim=16, depth=1, num_heads=2)), initial, tokens) is None
    assert fairness.ranges([1, 2, 3, 7, 9, 10]) == "1-3, 7, 9-10"


# ------------------------------------------------------------------ randomized positions


def test_random_positions_rows_train_with_the_option(tmp_path):
    out = tmp_path / "run"
    assert study(out, "--methods", "rope+random", "--steps", "4", "--random-positions", "256") == 0
    e = load(out)["methods"]["rope+random"]
    assert e["model"]["random_positions"] == 256 and e["row"]["random_positions"] == 256
    assert posenc.load_checkpoint(out / e["checkpoint"]).config.random_positions == 256


# ------------------------------------------------------------------ recall, and two runs


@pytest.fixture(scope="module")
def recall_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("recall") / "run"
    assert cli.main(["study", "--task", "recall", "--preset", "smoke", "--methods", "alibi", "learned", "rope", "rope+yarn",
                     "--steps", "6", "--eval-lengths", "32", "64", "--recall-sequences", "8", "--quiet",
                     "--threads", "1", "--out", str(out)]) == 0
    return out


def test_recall_study_writes_accuracy_by_distance(recall_run):
    res = load(recall_run)
    assert res["config"]["task"] == "recall" and res["corpus"]["source"].startswith("generated")
    for m in ("alibi", "rope", "rope+yarn"):
        for r in res["methods"][m]["eval"]:
            assert set(r["distances"]) == {"near", "middle", "far"} and 0 <= r["accuracy"] <= 1
            for d in r["distances"].values():
                assert d["queries"] == 8 * 4 and d["acc_low"] <= d["accuracy"] <= d["acc_high"]
        far = [r["distances"]["far"] for r in res["methods"][m]["eval"]]
        assert far[1]["distance_min"] > 32  # beyond the training length at 64
    assert res["methods"]["learned"]["eval"][1]["status"].startswith("cannot run past 32")
    with open(recall_run / "results.csv", newline="") as f:
        lines = list(csv.DictReader(f))
    assert len(lines) == 4 * 2 * 3 - 2 and {x["distance"] for x in lines} == {"near", "middle", "far", ""}
    assert (recall_run / "extrapolation.png").read_bytes()[:4] == b"\x89PNG"
    page = report.render(res, "r")
    assert "Recall by distance" in page and "recall far at 64" in page and page.count("data:image/png;base64,") == 2


def test_two_runs_side_by_side(tmp_path, three_seeds, recall_run, capsys):
    other = tmp_path / "other"
    assert study(other, *SEEDS[:-2], "--seeds", "1", "--seed", "5") == 0
    target = tmp_path / "c.html"
    assert cli.main(["report", str(three_seeds), str(other), "--out", str(target)]) == 0
    page = target.read_text()
    assert "seed: 0 -&gt; 5" in page and "B - A" in page and page.count("<tr><td>alibi</td><td>") >= 2
    # the printed difference is B's perplexity minus A's (the mean over A's three seeds)
    a = load(three_seeds)["methods"]["alibi"]["across_seeds"]["eval"][0]["perplexity"]
    b = load(other)["methods"]["alibi"]["eval"][0]["perplexity"]
    assert f"{b - a:+.3f} [" in page
    # scored on other windows: refused, saying what differs
    shorter = tmp_path / "shorter"
    assert study(shorter, *SEEDS[:-2], "--seeds", "1", "--eval-lengths", "32") == 0
    assert cli.main(["report", str(three_seeds), str(shorter), "--out", str(tmp_path / "x.html")]) == 2
    assert "scored on different windows (eval_lengths: [32, 64] -> [32])" in capsys.readouterr().err
    # a language-model study and a recall study: one summary with both axes
    assert cli.main(["report", str(three_seeds), str(recall_run), "--out", str(tmp_path / "both.html")]) == 0
    both = (tmp_path / "both.html").read_text()
    assert "Summary: perplexity and recall" in both and "recall far at 64" in both and "ppl at 1x" in both
