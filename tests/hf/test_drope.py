"""The DroPE recipe (Gelberg et al. 2025) on a tiny LlamaForCausalLM built from a config, in a few
steps: train with the model's own RoPE, ``posenc.hf.use(model, "nope")``, recalibrate, evaluate at
longer lengths with the study's evaluation. The same recipe, longer, is the one in docs/hf.md."""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import posenc.hf as phf  # noqa: E402
from posenc.study.data import train_batch  # noqa: E402
from posenc.study.hf_evaluation import evaluate  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def train(model, stream, steps: int, length: int, lr: float = 3e-3) -> list[float]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        x, y = train_batch(stream, 0, step, 4, length)
        loss = torch.nn.functional.cross_entropy(model(x, use_cache=False).logits.transpose(1, 2), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_drope_recipe_in_a_few_steps() -> None:
    g = torch.Generator().manual_seed(0)
    text = bytes(torch.randint(97, 123, (4000,), generator=g).tolist()) * 4  # repeats: something to learn
    stream = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    valid = stream[:1025].clone()
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    before = train(model, stream, 6, 32)
    rope_scores = evaluate(model, valid, [32, 128])

    phf.use(model, "nope")  # DroPE: the positions go, every other weight stays
    assert isinstance(model.model.rotary_emb, phf.adapter.RotaryStandIn)
    assert model.config.posenc["encoding"] == "nope"
    after = train(model, stream, 4, 32)
    scores = evaluate(model, valid, [32, 128])
    assert all(math.isfinite(v) for v in before + after)
    for results in (rope_scores, scores):
        assert set(results) == {32, 128}
        assert all(r["tokens"] == 1024 and math.isfinite(r["loss"]) for r in results.values())
    # without positions, a token's logits do not depend on where its context starts
    x = stream[:40].long()[None]
    with torch.no_grad():
        full = model(x, use_cache=False).logits[0, -1]
        assert torch.allclose(full, model(x, position_ids=torch.arange(40)[None] + 1000, use_cache=False).logits[0, -1])
