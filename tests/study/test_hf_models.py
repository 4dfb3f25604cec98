"""``posenc study --hf-config FILE``: the study's rows on a transformers architecture built from a
config file (posenc.study.hf_models). Tiny Llama and Qwen2 configs written to JSON, studies of a few steps
through the command line; the baseline row checked against a direct evaluation of the untouched
model written out here; the rope row against the baseline at initialisation; the errors."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config  # noqa: E402

from posenc import cli  # noqa: E402
from posenc.errors import UsageError  # noqa: E402
from posenc.study import StudyConfig, run_experiment  # noqa: E402
from posenc.study.data import load_corpus  # noqa: E402
from posenc.study.plan import check  # noqa: E402
from posenc.study.rows import parse as parse_row  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=32)
# A few steps of batch 4 at length 16, scored on 256 validation bytes (16 windows of 16, 8 of 32).
SMALL = ["--preset", "smoke", "--steps", "3", "--batch-size", "4", "--train-length", "16", "--eval-lengths", "16", "32",
         "--valid-bytes", "256", "--checkpoint-every", "100", "--quiet", "--threads", "1"]


def write_config(path, config) -> str:
    config.to_json_file(str(path))
    return str(path)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    words = [bytes(torch.randint(97, 123, (int(n),), generator=g).tolist()) for n in torch.randint(2, 8, (40,), generator=g)]
    body = b" ".join(words[int(i)] for i in torch.randint(0, 40, (3000,), generator=g))
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_bytes(body)
    return str(path)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return write_config(tmp_path_factory.mktemp("cfg") / "llama.json", LlamaConfig(vocab_size=256, **TINY))


def study(tmp_path, config: str, text: str, methods: list[str], *extra: str) -> dict:
    out = tmp_path / "run"
    code = cli.main(["study", *SMALL, "--data", text, "--hf-config", config, "--methods", *methods,
                     "--out", str(out), *extra])
    assert code == 0
    return json.loads((out / "results.json").read_text())


def finite(results: dict, rows: list[str], key: str = "perplexity") -> None:
    for row in rows:
        entry = results["methods"][row]
        assert entry["status"] == "done", row
        assert [e["length"] for e in entry["eval"]] == results["config"]["eval_lengths"]
        for e in entry["eval"]:
            assert e["status"] == "ok" and math.isfinite(e[key]) and e[key] > 0, (row, e)
        if key == "perplexity":
            assert all(e["ppl_low"] <= e["perplexity"] <= e["ppl_high"] for e in entry["eval"])


@pytest.mark.parametrize("model_type", ["gemma3_text", "gpt_oss", "deepseek_v3"])
def test_a_study_on_other_families(tmp_path, text, model_type: str) -> None:
    """--hf-config takes any family of posenc.hf's table: Gemma 3 (windows, a base per layer type),
    gpt-oss (sinks, YaRN), DeepSeek-V3 (MLA); each row keeps the family's windows and sinks."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/, where hf_family_configs.py is
    from hf_family_configs import config_kwargs

    kwargs = config_kwargs(model_type, vocab_size=256, hidden_size=32, head_dim=8, max_position_embeddings=64)
    config = write_config(tmp_path / f"{model_type}.json", transformers.AutoConfig.for_model(model_type, **kwargs))
    results = study(tmp_path, config, text, ["hf", "rope", "alibi"])
    finite(results, ["hf", "rope", "alibi"])
    hf, rope = (results["methods"][m]["eval"] for m in ("hf", "rope"))
    assert [e["perplexity"] for e in hf] == pytest.approx([e["perplexity"] for e in rope], rel=1e-4)


def test_llama_study_end_to_end_and_the_hf_row_is_the_untouched_model(tmp_path, llama, text) -> None:
    results = study(tmp_path, llama, text, ["hf", "rope", "alibi"])
    finite(results, ["hf", "rope", "alibi"])
    hf = results["hf"]
    raw = open(llama, "rb").read()
    assert hf["sha256"] == hashlib.sha256(raw).hexdigest() and hf["model_type"] == "llama"
    assert hf["config"] == json.loads(raw) and hf["vocab_size"] == 256 and hf["num_hidden_layers"] == 2
    assert results["config"]["dim"] is None and results["config"]["hf_config"] == llama  # sizes: the file's
    assert results["methods"]["hf"]["model"]["attention"] == "hf"
    assert results["methods"]["alibi"]["model"]["encoding"] == "alibi"

    # Independent check of the hf row: its final weights in a plain LlamaForCausalLM, scored here on the
    # same validation bytes in non-overlapping windows (256 targets: whole windows at 16 and 32), float64.
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "run" / "checkpoints" / "hf.safetensors"))
    model = LlamaForCausalLM(LlamaConfig.from_json_file(llama)).eval()
    assert model.config._attn_implementation == "sdpa"  # the model's own attention
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    valid = load_corpus(text, 256).valid.long()
    assert valid.numel() == 257
    for row in results["methods"]["hf"]["eval"]:
        n = row["length"]
        ids = torch.stack([valid[s: s + n + 1] for s in range(0, 256, n)])  # (256 / n, n + 1)
        with torch.no_grad():
            logits = model(ids[:, :-1], use_cache=False).logits.double()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), ids[:, 1:].reshape(-1), reduction="sum")
        assert row["tokens"] == 256 and row["windows"] == 256 // n
        assert row["loss"] == pytest.approx(float(nll) / 256, rel=1e-5, abs=1e-6)
    # The rope row (posenc's RoPE from the model's own parameters) trained the same model: the same numbers.
    for a, b in zip(results["methods"]["hf"]["eval"], results["methods"]["rope"]["eval"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
    assert results["methods"]["alibi"]["eval"][0]["loss"] != pytest.approx(results["methods"]["hf"]["eval"][0]["loss"], rel=1e-4)


def test_rope_row_equals_hf_row_at_initialisation(llama) -> None:
    from posenc.study.hf_models import HFModels

    cfg = check(StudyConfig.from_preset("smoke", methods=["hf", "rope", "alibi"], hf_config=llama, train_length=16,
                                        eval_lengths=[16, 32]))
    models = HFModels(cfg)
    hf, rope, alibi = (models.initial(parse_row(name), 3) for name in ("hf", "rope", "alibi"))
    for other in (rope, alibi):  # every row of a seed starts from the same transformer weights
        a, b = hf.state_dict(), other.state_dict()
        b = {k: v for k, v in b.items() if not k.endswith(".posenc_marker")}  # posenc.hf's marker (posenc.hf.adapter.MARKER)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(models.initial(parse_row("hf"), 4).model.lm_head.weight, hf.model.lm_head.weight)  # the seed matters
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, got, biased = hf.eval()(ids), rope.eval()(ids), alibi.eval()(ids)
    assert hf.model.config._attn_implementation == "sdpa" and rope.model.config._attn_implementation == "posenc"
    assert (got - ref).abs().max() < 1e-5
    assert (biased - ref).abs().max() > 1e-3  # a test that can fail: another encoding is another model
    # the fair options, as on posenc's own model: a learned table of the training length, T5's bound capped
    learned, t5 = models.build(parse_row("learned")), models.build(parse_row("t5:num_buckets=8"))
    assert learned.max_length == 16 and hf.max_length is None and t5.config.encoding_options == {"num_buckets": 8, "max_distance": 16}
    from posenc.study.evaluation import cannot_run

    assert "cannot run past 16" in cannot_run(learned, 32) and cannot_run(hf, 32) is None


def test_qwen2_recall_study_with_drop_and_finetuned_scaling_rows(tmp_path, text) -> None:
    qwen = write_config(tmp_path / "qwen2.json", Qwen2Config(vocab_size=300, tie_word_embeddings=True, **TINY))
    out = tmp_path / "run"
    args = ["study", "--preset", "smoke", "--task", "recall", "--steps", "3", "--batch-size", "4", "--train-length", "32",
            "--eval-lengths", "32", "64", "--recall-sequences", "4", "--finetune-steps", "2", "--drop-positions-after", "0.34",
            "--quiet", "--threads", "1",
            "--hf-config", qwen, "--methods", "hf", "rope+drop", "rope+yarn", "--out", str(out)]
    assert cli.main(args) == 0
    results = json.loads((out / "results.json").read_text())
    rows = ["hf", "rope+drop", "rope", "rope+yarn", "rope+yarn+ft"]
    assert list(results["methods"]) == rows
    finite(results, rows, key="accuracy")
    assert results["hf"]["model_type"] == "qwen2" and results["hf"]["vocab_size"] == 300
    assert results["methods"]["rope+drop"]["model"]["encoding"] == "nope"  # DroPE: no positions at the end
    assert results["methods"]["rope+drop"]["train"]["positions_dropped_at_step"] == 2
    ft = results["methods"]["rope+yarn+ft"]["model"]
    assert ft["scaling"]["rope_type"] == "yarn" and ft["scaling"]["factor"] == 2.0
    # The checkpoints load back into the row's model (tied weights included) and refuse another config file.
    from safetensors.torch import load_file

    from posenc.study.hf_models import HFModels, load_architecture

    cfg = check(StudyConfig.from_preset("smoke", task="recall", methods=["rope+drop"], hf_config=qwen, steps=3,
                                        train_length=32, eval_lengths=[32, 64], drop_positions_after=0.34))
    models = HFModels(cfg)
    for row in ("rope", "rope+drop"):
        path = out / "checkpoints" / f"{row}.safetensors"
        model = models.load(path, parse_row(row), torch.device("cpu"))
        assert model.model.lm_head.weight is model.model.model.embed_tokens.weight
        saved = load_file(str(path))
        assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
        assert model.config.to_dict() == results["methods"][row]["model"]
    other = write_config(tmp_path / "other.json", Qwen2Config(vocab_size=300, tie_word_embeddings=True, **TINY, rope_theta=500.0))
    with pytest.raises(UsageError, match="trained on another hf_config"):
        HFModels(cfg, load_architecture(other)).load(out / "checkpoints" / "rope.safetensors", parse_row("rope"),
                                                         torch.device("cpu"))


def config_error(tmp_path, **fields) -> str:
    with pytest.raises(UsageError) as err:
        check(StudyConfig.from_preset("smoke", **{"methods": ["hf", "rope"], **fields}))
    return str(err.value)


def test_config_file_errors(tmp_path, llama) -> None:
    small = write_config(tmp_path / "small.json", LlamaConfig(vocab_size=100, **TINY))
    assert "vocab_size must be an integer >= 256" in config_error(tmp_path, hf_config=small)
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"model_type": "gpt2", "n_embd": 32}))
    message = config_error(tmp_path, hf_config=str(gpt2))
    assert "model_type" in message and "'llama', 'mistral'" in message and "'gpt2'" in message
    assert "is not a file" in config_error(tmp_path, hf_config=str(tmp_path / "missing.json"))
    assert "dim: the model's sizes come from hf_config" in config_error(tmp_path, hf_config=llama, dim=64)
    assert "'hf' is the own attention" in config_error(tmp_path)  # without hf_config
    assert "+random is not supported" in config_error(tmp_path, hf_config=llama, methods=["rope+random"])
    assert "no options or variants" in config_error(tmp_path, hf_config=llama, methods=["hf+yarn"])
    assert "pack_documents" in config_error(tmp_path, hf_config=llama, pack_documents=True)


def test_size_flags_and_resume_with_another_config_are_refused(tmp_path, llama, text, capsys) -> None:
    out = tmp_path / "run"
    base = ["study", *SMALL, "--data", text, "--methods", "hf", "--out", str(out)]
    assert cli.main([*base, "--hf-config", llama, "--dim", "32"]) == 2  # even at the file's own width
    assert "leave out --dim" in capsys.readouterr().err and not out.exists()
    assert cli.main([*base, "--hf-config", llama, "--steps", "1"]) == 0
    other = write_config(tmp_path / "other.json", LlamaConfig(vocab_size=256, **{**TINY, "num_hidden_layers": 1}))
    capsys.readouterr()
    assert cli.main(["study", "--resume", "--out", str(out), "--hf-config", other, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "resume" in err and "hf_config" in err and hashlib.sha256(open(other, "rb").read()).hexdigest() in err
    assert cli.main(["study", "--resume", "--out", str(out), "--hf-config", llama, "--depth", "2", "--quiet"]) == 2
    assert "leave out --depth" in capsys.readouterr().err
    with pytest.raises(UsageError, match="was trained on hf_config .*posenc.s own model"):  # the same study, no file
        run_experiment(StudyConfig.from_preset("smoke", methods=["rope"], steps=1, batch_size=4, train_length=16,
                                               eval_lengths=[16, 32], valid_bytes=256, data=text), out, resume=True,
                       progress=False)


def test_help_names_the_option(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["study", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--hf-config FILE" in out and "AutoModelForCausalLM.from_config(FILE)" in out and "the row hf" in out


def test_an_interrupted_row_resumes_to_the_numbers_of_an_uninterrupted_run(tmp_path, llama, text) -> None:
    def config() -> StudyConfig:
        return StudyConfig.from_preset("smoke", methods=["t5:num_buckets=8"], hf_config=llama, steps=4, batch_size=4,
                                       train_length=16, eval_lengths=[16, 32], valid_bytes=256, data=text,
                                       checkpoint_every=1)

    whole = run_experiment(config(), tmp_path / "whole", progress=False)

    def stop(label: str, step: int) -> None:
        if step == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_experiment(config(), tmp_path / "cut", progress=False, on_step=stop)
    assert (tmp_path / "cut" / "state" / "t5_num_buckets-8.pt").exists()
    resumed = run_experiment(config(), tmp_path / "cut", resume=True, progress=False)
    a, b = whole["methods"]["t5:num_buckets=8"], resumed["methods"]["t5:num_buckets=8"]
    assert b["train"]["losses"] == a["train"]["losses"]
    assert [e["loss"] for e in b["eval"]] == pytest.approx([e["loss"] for e in a["eval"]], rel=1e-6)
