"""posenc extend of a transformers model: its columns against transformers' own models (the model
untouched, the scaling written as rope_parameters), the saved folder loaded back, refusals."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import posenc.hf as ph  # noqa: E402
from posenc.cli import main  # noqa: E402
from posenc.errors import UsageError  # noqa: E402
from posenc.extend import extend as ex  # noqa: E402
from posenc.study.data import load_corpus  # noqa: E402
from posenc.study.hf_evaluation import evaluate  # noqa: E402

T = 32  # the model's training length (its max_position_embeddings)


def tiny_llama(vocab: int = 256, **extra) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, vocab_size=vocab, max_position_embeddings=T, **extra)
    return transformers.LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-extend")
    text = root / "corpus.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(2000)))
    tiny_llama().save_pretrained(root / "llama")
    return root, text


def _run(setup, tmp_path, scaling: str, steps: int = 4, *more: str) -> dict:
    root, text = setup
    code = main(["extend", str(root / "llama"), "--out", str(tmp_path / scaling), "--scaling", scaling, "--length",
                 str(2 * T), "--steps", str(steps), "--eval-lengths", str(T), str(2 * T), "--valid-bytes", "1024",
                 "--data", str(text), "--batch-size", "2", "--no-progress", *more])
    assert code == 0
    return json.loads((tmp_path / scaling / "extend.json").read_text())


def _scores(record: dict, column: str) -> dict[int, float]:
    return {s["length"]: s["perplexity"] for s in record["scores"][column]}


def _ppl(model, text) -> dict[int, float]:
    valid = load_corpus(str(text), 1024).valid
    return {n: r["perplexity"] for n, r in evaluate(model, valid, [T, 2 * T]).items()}


def test_yarn_columns_equal_transformers_own_models(setup, tmp_path):
    root, text = setup
    record = _run(setup, tmp_path, "yarn")
    assert record["settings"]["train_length"] == T  # read from max_position_embeddings
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "llama")
    assert _scores(record, "base") == pytest.approx(_ppl(base, text), rel=1e-5)
    # zero-shot: transformers' own YaRN with the same block and weights
    block = {k: v for k, v in record["scaling"].items()}
    config = transformers.AutoConfig.from_pretrained(root / "llama")
    config.rope_parameters = {**block, "rope_theta": config.rope_parameters["rope_theta"]}
    theirs = transformers.AutoModelForCausalLM.from_pretrained(root / "llama", config=config)
    assert _scores(record, "zero_shot") == pytest.approx(_ppl(theirs, text), rel=1e-4)
    # extended: a plain transformers checkpoint, loaded without posenc, scores as extend.json says
    assert record["saved"] == {"weights": "model", "format": "transformers"}
    saved = json.loads((tmp_path / "yarn" / "model" / "config.json").read_text())
    assert saved["rope_parameters"]["rope_type"] == "yarn" and not [k for k in saved if "posenc" in k]
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "yarn" / "model")
    assert _scores(record, "extended") == pytest.approx(_ppl(plain, text), rel=1e-4)
    assert _scores(record, "extended") != _scores(record, "zero_shot")  # it trained
    assert len(record["train"]["losses"]) == 4
    table = json.loads((tmp_path / "yarn" / "table.json").read_text())
    assert [r["length"] for r in table["rows"]] == [T, 2 * T]


def test_drope_and_ntk_are_saved_for_posenc_hf(setup, tmp_path):
    root, text = setup
    for scaling in ("drope", "ntk"):
        record = _run(setup, tmp_path, scaling)
        assert record["saved"]["format"] == "posenc.hf"
        back = ph.from_pretrained(transformers.AutoModelForCausalLM, tmp_path / scaling / "model")
        assert back.config.posenc["encoding"] == ("nope" if scaling == "drope" else "rope")
        assert _scores(record, "extended") == pytest.approx(_ppl(back, text), rel=1e-4)
    # DroPE's zero-shot column: transformers' model with posenc's NoPE (the positions dropped)
    dropped = ph.use(transformers.AutoModelForCausalLM.from_pretrained(root / "llama"), "nope")
    record = json.loads((tmp_path / "drope" / "extend.json").read_text())
    assert _scores(record, "zero_shot") == pytest.approx(_ppl(dropped, text), rel=1e-5)


def test_resume_of_a_finished_extension_gives_its_record(setup, tmp_path):
    first = _run(setup, tmp_path, "linear", 2)
    again = _run(setup, tmp_path, "linear", 2, "--resume")
    assert again["scores"] == first["scores"] and again["train"] == first["train"]


def test_an_in_memory_model_is_left_as_it_was(setup, tmp_path):
    root, text = setup
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = ex.ExtendConfig(scaling="llama3", length=2 * T, steps=1, train_length=T, data=str(text), valid_bytes=1024,
                          batch_size=2, eval_lengths=[2 * T])
    record = ex.extend(model, tmp_path / "mem", cfg, progress=False)
    assert record["saved"]["format"] == "transformers" and "in memory" in record["checkpoint"]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert getattr(model.config, "posenc", None) is None


@pytest.mark.parametrize("model, named", [
    (lambda: tiny_llama(vocab=128), "vocab_size"),
    (lambda: tiny_llama(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), "already has"),
])
def test_what_cannot_be_extended_is_refused(setup, tmp_path, model, named):
    _, text = setup
    cfg = ex.ExtendConfig(scaling="yarn", length=2 * T, steps=1, train_length=T, data=str(text), valid_bytes=1024)
    with pytest.raises(UsageError, match=named):
        ex.extend(model(), tmp_path / "x", cfg, progress=False)


def test_packed_documents_are_refused_for_a_transformers_model(setup, tmp_path):
    _, text = setup
    cfg = ex.ExtendConfig(scaling="yarn", length=2 * T, steps=1, train_length=T, data=str(text), valid_bytes=1024,
                          pack_documents=True)
    with pytest.raises(UsageError, match="pack_documents"):
        ex.extend(tiny_llama(), tmp_path / "x", cfg, progress=False)


@pytest.mark.parametrize("encoding, options", [("alibi", {}), ("nope", {}), ("t5", {}),
                                               ("rope", {"scaling": {"rope_type": "linear", "factor": 2.0}}),
                                               ("rope", {"base": 500000.0}), ("1x[rope] 1x[nope]", {})])
@pytest.mark.parametrize("saved", [False, True])
def test_a_model_running_another_encoding_is_refused(setup, tmp_path, encoding, options, saved):
    """A model after posenc.hf.use with anything but its own RoPE (another encoding, a scaling, another
    base, a schedule), in memory or saved: its base column scored posenc's encoding while the extended
    columns scored the config's own RoPE on its weights (issue 48 item 3)."""
    _, text = setup
    model = ph.use(tiny_llama(), encoding, **options)
    checkpoint = model
    if saved:
        model.save_pretrained(tmp_path / "saved")
        checkpoint = tmp_path / "saved"
    cfg = ex.ExtendConfig(scaling="yarn", length=2 * T, steps=1, train_length=T, data=str(text), valid_bytes=1024)
    with pytest.raises(UsageError, match="not its own RoPE"):
        ex.extend(checkpoint, tmp_path / "x", cfg, progress=False)


def test_a_model_after_use_rope_is_its_own_rope(setup, tmp_path):
    """use(model, "rope") keeps the model's own RoPE: still extended."""
    _, text = setup
    cfg = ex.ExtendConfig(scaling="linear", length=2 * T, steps=1, train_length=T, data=str(text), valid_bytes=1024,
                          batch_size=2, eval_lengths=[2 * T])
    record = ex.extend(ph.use(tiny_llama(), "rope"), tmp_path / "own", cfg, progress=False)
    assert record["saved"]["format"] == "transformers"
