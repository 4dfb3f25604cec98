"""Position ids that increase but skip (PoSE's chunks) in a transformers model after posenc.hf.use:
one document, each token at its own id, as the untouched model with an all-causal mask reads them;
only an id that does not increase starts a new packed document."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import posenc.hf as phf  # noqa: E402
from hf_family_configs import logits  # noqa: E402 (tests/hf_family_configs.py: the ids and logits every hf test uses)
from posenc.errors import UsageError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
DEFAULT = {"rope_type": "default", "rope_theta": 10000.0}


def llama(rope: dict) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rope_parameters=dict(rope), pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def skipping(*chunks: tuple[int, int]) -> torch.Tensor:
    """(1, T) ids: each (start, length) chunk consecutive, the chunks increasing with gaps."""
    return torch.cat([torch.arange(s, s + n) for s, n in chunks])[None]


def reference(model, ids, pos) -> torch.Tensor:
    # transformers' own model: an all-ones mask makes its mask all-causal (no packed-sequence
    # detection from position_ids), each token rotated at its own id
    return logits(model, ids, position_ids=pos, attention_mask=torch.ones_like(ids))


def _tokens(batch: int, length: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("how", ["scaling given", "from config"])
def test_yarn_with_skipping_ids_equals_transformers(how: str) -> None:
    ref = llama(YARN)
    model = phf.use(copy.deepcopy(ref), "rope", **({"scaling": dict(YARN)} if how == "scaling given" else {}))
    assert model.model.posenc_encodings[0].scaling.rope_type == "yarn"
    pos = skipping((0, 10), (27, 8), (50, 12))  # PoSE-like: 30 tokens over ids up to 61
    ids = _tokens(1, pos.shape[1])
    want = reference(ref, ids, pos)
    assert float((logits(model, ids, position_ids=pos) - want).abs().max()) < 1e-5
    assert float((logits(model, ids, position_ids=pos, use_cache=False) - want).abs().max()) < 1e-5
    # not the model read as three documents (attention does cross the skips)
    docs = torch.cat([logits(ref, part[None], position_ids=p[None]) for part, p in
                      zip(ids[0].split([10, 8, 12]), pos[0].split([10, 8, 12]))], dim=1)
    assert float((want - docs).abs().max()) > 1e-3


def test_rows_with_their_own_skipping_ids() -> None:
    ref = llama(YARN)
    model = phf.use(copy.deepcopy(ref), "rope", scaling=dict(YARN))
    pos = torch.cat([skipping((0, 9), (40, 11)), skipping((0, 4), (10, 6), (33, 10))])  # (2, 20)
    ids = _tokens(2, 20)
    assert float((logits(model, ids, position_ids=pos) - reference(ref, ids, pos)).abs().max()) < 1e-5


def test_own_rotary_path_with_skipping_ids() -> None:
    # use(model, "rope") on a plain RoPE: the model's own rotary rotates q and k at position_ids
    ref = llama(DEFAULT)
    model = phf.use(copy.deepcopy(ref), "rope")
    pos = skipping((0, 8), (21, 8), (45, 8))
    ids = _tokens(1, 24)
    assert float((logits(model, ids, position_ids=pos) - reference(ref, ids, pos)).abs().max()) < 1e-5


@pytest.mark.parametrize("rope", [DEFAULT, YARN])
def test_a_restart_still_starts_a_document(rope: dict) -> None:
    # two packed documents, each with skipping ids: the restart (an id <= the one before) separates them
    ref = llama(rope)
    model = phf.use(copy.deepcopy(ref), "rope")
    first, second = skipping((0, 6), (20, 6)), skipping((0, 5), (30, 7))
    pos = torch.cat([first, second], dim=1)
    ids = _tokens(1, pos.shape[1])
    alone = torch.cat([reference(ref, ids[:, :12], first), reference(ref, ids[:, 12:], second)], dim=1)
    assert float((logits(model, ids, position_ids=pos) - alone).abs().max()) < 1e-5
    # an id equal to the one before is a restart too
    same = torch.cat([skipping((0, 6)), skipping((5, 6))], dim=1)
    alone = torch.cat([reference(ref, ids[:, :6], same[:, :6]), reference(ref, ids[:, 6:12], same[:, 6:])], dim=1)
    assert float((logits(model, ids[:, :12], position_ids=same) - alone).abs().max()) < 1e-5


def test_skipping_queries_after_a_cache_are_refused() -> None:
    model = phf.use(llama(YARN), "rope", scaling=dict(YARN))
    ids = _tokens(1, 12)
    with torch.no_grad():
        out = model(ids[:, :8], position_ids=torch.arange(8)[None], use_cache=True)
        with pytest.raises(UsageError, match="position_ids"):
            model(ids[:, 8:], position_ids=torch.tensor([[8, 9, 20, 21]]), cache=out.cache)
