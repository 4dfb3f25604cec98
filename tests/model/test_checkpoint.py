"""Checkpoints (posenc/checkpoint.py): the weights file is the path, a posenc.hf checkpoint needs posenc to load,
and what was saved loads back (RoPE-Mixed with grouped key heads). Each case asserts the exact message
or the result, against transformers own classes."""

from __future__ import annotations

import re

import pytest
import torch

import posenc
import posenc.hf
from posenc.errors import UsageError

transformers = pytest.importorskip("transformers")


def raises(message: str):
    return pytest.raises(UsageError, match=f"^{re.escape(message)}$")


def _llama(kv_heads: int = 2) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=kv_heads)
    return transformers.LlamaForCausalLM(config).eval()


PLAIN_LOAD = ("LlamaAttention 0: attn_implementation='posenc' needs posenc.hf.use(model, encoding) first "
              "(a model saved after use: load it with posenc.hf.from_pretrained)")



def test_a_checkpoint_path_other_than_the_weights_file_is_refused(tmp_path) -> None:
    model = posenc.LM(posenc.LMConfig(dim=16, num_heads=2, depth=1, vocab_size=32))
    for name in ("x.json", "x", "x.pt"):
        with raises(f"path: give the weights file NAME.safetensors (its json NAME.json is written beside it), "
                    f"got {str(tmp_path / name)!r}"):
            posenc.save_checkpoint(model, tmp_path / name)
    assert list(tmp_path.iterdir()) == []  # nothing written
    mine = tmp_path / "config.json"
    mine.write_text('{"mine": 1}')
    with raises(f"path: {mine} exists and is not a posenc checkpoint's json; refusing to replace it "
                "(choose another NAME.safetensors, or move the file)"):
        posenc.save_checkpoint(model, tmp_path / "config.safetensors")
    assert mine.read_text() == '{"mine": 1}' and not (tmp_path / "config.safetensors").exists()
    # The weights file and its json: saved twice (a rerun), loaded back with the same weights.
    path = tmp_path / "m.safetensors"
    posenc.save_checkpoint(model, path)
    posenc.save_checkpoint(model, path)
    back = posenc.load_checkpoint(path)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values()))


@pytest.mark.parametrize("method", ["nope", "alibi", "sinusoidal", "sandwich", "xpos", "axial_rope", "t5"])
def test_a_plain_load_of_a_posenc_checkpoint_fails(method, tmp_path, monkeypatch) -> None:
    """Before: the model's own RoPE, without a word, for every method without weights."""
    torch.manual_seed(0)
    model = posenc.hf.use(_llama(), method)
    model.save_pretrained(tmp_path)
    assert transformers.AutoConfig.from_pretrained(tmp_path)._attn_implementation == "posenc"
    ids = torch.randint(0, 64, (1, 9))
    # posenc's attention registered (this process used posenc.hf): the model builds, its first forward stops
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    with raises(PLAIN_LOAD):
        plain(ids)
    # a process that never imported posenc.hf: transformers refuses to build it
    monkeypatch.delitem(transformers.AttentionInterface._global_mapping, "posenc")
    with pytest.raises(ValueError, match=re.escape('Specified `attn_implementation="posenc"` is not supported')):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    monkeypatch.undo()
    # the way it loads: the same logits as the saved model
    back = posenc.hf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, rtol=0, atol=1e-6)
    # the model's own attention, asked for in writing: the model's own RoPE
    own = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    assert type(own.model.rotary_emb).__name__ == "LlamaRotaryEmbedding"


def test_rope_mixed_with_grouped_query_heads_reloads(tmp_path) -> None:
    """Before: a size mismatch (frequencies (2, 2, 4) saved, (2, 4, 4) rebuilt) and a RuntimeError."""
    torch.manual_seed(0)
    model = posenc.hf.use(_llama(kv_heads=2), "rope_mixed")
    with torch.no_grad():
        model.model.posenc_encodings[0].frequencies.add_(0.1)  # trained away from the initialisation
    model.save_pretrained(tmp_path)
    back = posenc.hf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path)
    assert back.model.posenc_encodings[0].num_kv_heads == 2
    assert torch.equal(back.model.posenc_encodings[0].frequencies, model.model.posenc_encodings[0].frequencies)
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, rtol=0, atol=1e-6)
