"""posenc extend --remap: training-free position remaps of the model's own RoPE as zero-shot columns,
on a posenc checkpoint and a transformers folder; SelfExtend with group 1 (plain RoPE) equals the
base column; bad names and options are UsageErrors naming remap."""

from __future__ import annotations

import json
import math

import pytest
import torch

import posenc
from models import tiny_rope_checkpoint
from posenc.cli import main
from posenc.errors import UsageError
from posenc.extend import extend as ex
from posenc.extend.checkpoint_kinds import remapped
from posenc.extend.extend_config import parse_remap

pytestmark = pytest.mark.usefixtures("one_thread")

REMAPS = ["selfextend:group=1,window=4", "selfextend:group=4,window=8", "dca:chunk_size=16,local_size=4"]
LABELS = ["selfextend group=1 window=4", "selfextend group=4 window=8", "dca chunk_size=16 local_size=4"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("remap")
    return root, tiny_rope_checkpoint(root)[1]


def _args(ckpt, text, out, *more):
    return ["extend", str(ckpt), "--out", str(out), "--scaling", "yarn", "--train-length", "16", "--length", "64",
            "--steps", "0", "--data", str(text), "--valid-bytes", "512", "--eval-lengths", "16", "64", "--threads", "1",
            "--no-progress", *more]


def _check(out, record):
    scores = record["scores"]
    base = {s["length"]: s["perplexity"] for s in scores["base"]}
    for label in LABELS:
        column = {s["length"]: s["perplexity"] for s in scores[f"remap:{label}"]}
        assert set(column) == {16, 64} and all(math.isfinite(v) for v in column.values())
        assert all(label in row for row in record["table"])
    plain = {s["length"]: s["perplexity"] for s in scores[f"remap:{LABELS[0]}"]}
    for n in (16, 64):  # group 1 is plain RoPE: the base column
        assert plain[n] == pytest.approx(base[n], rel=1e-7)  # (float32 rounding of the merged regions: ~1e-8)
    far = {s["length"]: s["perplexity"] for s in scores[f"remap:{LABELS[1]}"]}
    assert far[64] != pytest.approx(base[64], rel=1e-6)  # grouping past the window changes the model
    header = (out / "table.csv").read_text().splitlines()[0].split(",")
    assert header[4:] == [f"{label.replace(' ', '_')}_zero_shot_perplexity" for label in LABELS]
    assert json.loads((out / "table.json").read_text())["remaps"][1] == {"name": "selfextend", "options": {"group": 4, "window": 8}}


def test_remap_columns_of_a_posenc_checkpoint(tiny, tmp_path, capsys):
    root, text = tiny
    more = [arg for spec in REMAPS for arg in ("--remap", spec)]
    assert main(_args(root / "rope.safetensors", text, tmp_path / "out", *more)) == 0
    record = json.loads((tmp_path / "out" / "extend.json").read_text())
    assert record["settings"]["remaps"][0] == {"name": "selfextend", "options": {"group": 1, "window": 4}}
    _check(tmp_path / "out", record)
    assert "selfextend group=4 window=8 zero-shot" in capsys.readouterr().err
    # the remapped model is the checkpoint's RoPE under the remap
    model = remapped(posenc.load_checkpoint(root / "rope.safetensors"), parse_remap(REMAPS[1]))
    assert model.config.encoding == "selfextend" and model.config.encoding_options["group"] == 4
    # a run without remaps keeps its settings as before (no remaps key)
    assert main(_args(root / "rope.safetensors", text, tmp_path / "plain")) == 0
    assert "remaps" not in json.loads((tmp_path / "plain" / "extend.json").read_text())["settings"]


def test_remap_columns_of_a_transformers_folder(tiny, tmp_path):
    transformers = pytest.importorskip("transformers")
    root, text = tiny
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                      intermediate_size=32, vocab_size=256, max_position_embeddings=16)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    cfg = ex.ExtendConfig(scaling="yarn", length=64, train_length=16, steps=0, data=str(text), valid_bytes=512,
                          eval_lengths=[16, 64], remaps=REMAPS)
    record = ex.extend(tmp_path / "llama", tmp_path / "out", cfg, progress=False)
    _check(tmp_path / "out", record)


@pytest.mark.parametrize("spec, named", [("nope", "not a position remap"), ("selfextend:gruop=2", "no option 'gruop'"),
                                         ("selfextend:base=500", "own RoPE"), ("selfextend:group=0", "group must be"),
                                         ("rerope:window", "KEY=VALUE")])
def test_bad_remaps_name_the_option(tiny, tmp_path, spec, named):
    root, text = tiny
    with pytest.raises(UsageError, match=f"remap.*{named}"):
        ex.ExtendConfig(scaling="yarn", length=64, train_length=16, steps=0, remaps=[spec])
    assert main(_args(root / "rope.safetensors", text, tmp_path / "bad", "--remap", spec)) == 2
    assert not (tmp_path / "bad").exists()
