"""Bad inputs of the extend command line that raised raw exceptions (issue 48, items 14 and 20): each
is now one UsageError naming the option."""

from __future__ import annotations

import pytest
import torch

from posenc.errors import UsageError
from posenc.extend.extend_cli import check_run_options


@pytest.mark.parametrize("device, threads, word", [("banana", None, "device"), ("cpu", 0, "threads"), ("cpu", -2, "threads")])
def test_extend_refuses_a_bad_device_or_thread_count(device: str, threads: int | None, word: str) -> None:
    with pytest.raises(UsageError, match=word):
        check_run_options(device, threads)
    check_run_options("cpu", 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA accepts cuda")
def test_extend_refuses_cuda_without_a_gpu() -> None:
    with pytest.raises(UsageError, match="cuda"):
        check_run_options("cuda", None)


def test_extend_refuses_a_schedule_checkpoint_naming_its_schedule() -> None:
    """Not a message about encoding_options, which the user never gave (issue 48, item 17)."""
    import posenc
    from posenc.study.variants import scaled

    lm = posenc.LM(posenc.LMConfig(schedule="2x[rope window=8] 2x[rope]", dim=16, depth=4, num_heads=2))
    with pytest.raises(UsageError, match="schedule") as caught:
        scaled(lm, {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16})
    assert "encoding_options" not in str(caught.value)


def _tiny_llama(folder):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, intermediate_size=64,
                                      vocab_size=256, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _corrupt_json(folder):
    (folder / "config.json").write_text('{"model_type": "llama", ')


def _a_list(folder):
    (folder / "config.json").write_text('["llama"]')


def _unknown_type(folder):
    (folder / "config.json").write_text('{"model_type": "no_such_model", "max_position_embeddings": 64}')


def _no_weights(folder):
    (folder / "model.safetensors").unlink()


def _truncated(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:1000])


def _truncated_bin(folder):
    from safetensors.torch import load_file

    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save(weights, folder / "pytorch_model.bin")
    data = (folder / "pytorch_model.bin").read_bytes()
    (folder / "pytorch_model.bin").write_bytes(data[:3000])


def _emptied(folder):
    for path in folder.iterdir():
        path.unlink()


@pytest.mark.parametrize("train_length", [None, 64])
@pytest.mark.parametrize("spoil, words", [
    (_corrupt_json, "config.json is not a readable JSON"), (_a_list, "one JSON object"),
    (_unknown_type, "no_such_model"), (_no_weights, "no weights"), (_truncated, "model.safetensors is not a readable"),
    (_truncated_bin, "pytorch_model.bin is not a readable"), (_emptied, "holds neither a config.json"),
], ids=["corrupt-json", "list-json", "unknown-model-type", "no-weights", "truncated-safetensors", "truncated-bin", "empty"])
def test_extend_names_a_broken_transformers_folder_in_one_line(tmp_path, capsys, spoil, words, train_length) -> None:
    """``posenc extend`` on a folder with a corrupt config.json, without weights, with a truncated
    weight file, or empty: exit status 2 and one line naming the file, never a traceback or a
    message about --train-length that hides the broken file (issue 48, item 14)."""
    from posenc import cli

    folder = _tiny_llama(tmp_path / "model")
    spoil(folder)
    capsys.readouterr()
    extra = [] if train_length is None else ["--train-length", str(train_length)]
    code = cli.main(["extend", str(folder), "--out", str(tmp_path / "out"), "--scaling", "linear", "--steps", "0",
                     "--length", "128", "--no-progress", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and words in err and "train-length" not in err, err


@pytest.mark.parametrize("options, word", [(["--device", "banana"], "device"), (["--threads", "0"], "threads"),
                                           (["--device", "cuda"], "cuda")])
def test_extend_command_refuses_a_bad_device_or_thread_count_in_one_line(tmp_path, capsys, options, word) -> None:
    from posenc import cli

    if "cuda" in options and torch.cuda.is_available():
        pytest.skip("a machine with CUDA accepts cuda")
    folder = _tiny_llama(tmp_path / "model")
    capsys.readouterr()
    code = cli.main(["extend", str(folder), "--out", str(tmp_path / "out"), "--scaling", "linear", "--steps", "0",
                     "--length", "128", "--no-progress", *options])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and word in err, err


def test_extend_names_a_checkpoint_that_does_not_exist(tmp_path, capsys) -> None:
    from posenc import cli

    code = cli.main(["extend", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out"), "--scaling", "linear",
                     "--steps", "0", "--length", "128", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "does not exist" in err and "train-length" not in err, err


def _longrope_block(**kw) -> dict:
    return {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1.5, 2.0, 2.5, 3.0],
            "original_max_position_embeddings": 32, "factor": 2.0, **kw}


@pytest.mark.parametrize("block, words", [
    (_longrope_block(rope_type="yarn"), "rope_type is 'yarn'.*--scaling yarn"),
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}, "rope_type is 'yarn'"),
    (_longrope_block(original_max_position_embeddings=10**9), "original_max_position_embeddings \\(1000000000\\)"),
    (_longrope_block(original_max_position_embeddings=16), "original_max_position_embeddings \\(16\\) must be the train length \\(32\\)"),
    ([1.0, 2.0], "a block is a JSON object"),
])
def test_a_given_longrope_block_is_checked_against_the_run(block, words) -> None:
    """``--longrope-block``: another type's block, or one whose original length is not the run's train
    length, is refused (issue 48, item 23: a yarn block ran under --scaling longrope; an original length
    of 1e9 never scaled anything)."""
    from posenc.extend.extend_config import ExtendConfig

    with pytest.raises(UsageError, match=words):
        ExtendConfig(scaling="longrope", length=64, steps=0, train_length=32, longrope=block)
    ExtendConfig(scaling="longrope", length=64, steps=0, train_length=32, longrope=_longrope_block())
