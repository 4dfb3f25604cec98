"""LongRoPE's search: its block read by transformers, a seeded search reproduces, the constraint holds."""

from __future__ import annotations

import json
import math

import pytest
import torch

import posenc
from posenc import LM, LMConfig
from posenc.errors import UsageError
from posenc.study import longrope_search as ls

T, TARGET = 16, 64


@pytest.fixture(scope="module")
def model() -> LM:
    torch.manual_seed(0)
    return LM(LMConfig(encoding="rope", dim=32, depth=1, num_heads=2))


@pytest.fixture(scope="module")
def valid() -> torch.Tensor:
    return torch.randint(0, 256, (3 * TARGET + 1,), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)


def settings(**kw) -> ls.SearchSettings:
    return ls.SearchSettings(**{"train_length": T, "target_length": TARGET, "sequences": 2, "population": 6,
                                "generations": 2, "parents": 3, "mutations": 4, "crossovers": 3, "seed": 3, **kw})


def test_searched_block_gives_transformers_inv_freq_and_attention_factor(model, valid):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    block = ls.search(model, valid, settings()).block()
    config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, intermediate_size=64,
                                      vocab_size=256, max_position_embeddings=TARGET, rope_parameters=dict(block))
    for length in (T, TARGET):  # short_factor at the training length, long_factor past it
        theirs, attention = ROPE_INIT_FUNCTIONS["longrope"](config, torch.device("cpu"), seq_len=length)
        for enc in (posenc.build("rope", num_heads=2, head_dim=16, scaling=block), posenc.rope_from_hf(config)):
            torch.testing.assert_close(enc.frequencies(length), theirs, rtol=1e-6, atol=0)
            assert enc.attention_factor == pytest.approx(attention, rel=1e-12)
    assert attention == pytest.approx(math.sqrt(1 + math.log(TARGET / T) / math.log(T)))


def test_seeded_search_gives_the_same_factors_twice_and_resumes(model, valid, tmp_path):
    first = ls.search(model, valid, settings())
    events: list = []
    second = ls.search(model, valid, settings(), report=events.append)
    assert first.best == second.best and first.perplexity == second.perplexity
    # every evaluated individual reported, in order, with the best so far (events, not lines printed here)
    assert [(e.generation, e.evaluated) for e in events] == [(r["generation"], i + 1) for i, r in enumerate(second.evaluated)]
    assert events[-1].best == min(r["perplexity"] for r in second.evaluated if r["perplexity"] is not None)
    assert [r["factors"] for r in first.evaluated] == [r["factors"] for r in second.evaluated]
    # interrupted after 5 individuals: the state keeps them, a resumed search ends where an unbroken one does
    state = tmp_path / "state.json"
    calls = {"n": 0}
    original = ls._Search._perplexity

    def stop_after_five(self):
        calls["n"] += 1
        if calls["n"] > 5:
            raise KeyboardInterrupt
        return original(self)

    ls._Search._perplexity = stop_after_five
    try:
        with pytest.raises(KeyboardInterrupt):
            ls.search(model, valid, settings(), state=state)
    finally:
        ls._Search._perplexity = original
    assert len(json.loads(state.read_text())["evaluated"]) == 5
    with pytest.raises(UsageError, match="resume"):
        ls.search(model, valid, settings(), state=state)
    resumed = ls.search(model, valid, settings(), state=state, resume=True)
    assert resumed.best == first.best and len(resumed.evaluated) == len(first.evaluated)
    with pytest.raises(UsageError, match="other settings"):
        ls.search(model, valid, settings(seed=4), state=state, resume=True)


def test_no_evaluated_individual_breaks_the_monotone_constraint(model, valid):
    s = settings(step=2.0, mutation_rate=0.9, start_tokens=(0, 2, 4))  # wild mutations: many draws break it
    result = ls.search(model, valid, s)
    assert len(result.evaluated) > s.population
    for record in result.evaluated:
        f = record["factors"]
        assert all(1.0 <= a <= b <= s.upper for a, b in zip(f, f[1:])) and f[0] >= 1.0
        assert record["start"] in (0, 2, 4)
    # the seeds: PI is s everywhere, NTK and YaRN keep the fastest pair and interpolate the slowest by s
    first = result.evaluated[:3]
    assert first[0]["factors"] == [4.0] * 8
    assert first[1]["factors"][0] == 1.0 and first[1]["factors"][-1] == pytest.approx(4.0)
    assert first[2]["factors"][0] == 1.0 and first[2]["factors"][-1] == pytest.approx(4.0)
    if result.best.start:
        with pytest.raises(UsageError, match="start_tokens"):
            result.block()


def test_kept_start_rotates_the_first_positions_unscaled(model, valid):
    enc = model.attentions()[0].encoding
    theta = ls.default_frequencies(enc.base, enc.rotary_dim)
    block = ls.longrope_block([4.0] * 8, T, 4.0, enc.base)
    with ls._applied([enc], block, 3, theta, TARGET):
        cos, _ = enc.cos_sin(torch.arange(TARGET), TARGET)
    angles = torch.arange(TARGET, dtype=torch.float64)[:, None] * theta[None]
    torch.testing.assert_close(cos[:3], angles[:3].cos().float())
    torch.testing.assert_close(cos[3:], (angles[3:] / 4).cos().float())
    assert enc.scaling.rope_type == "default"  # undone after the block


def test_bad_settings_name_the_parameter():
    with pytest.raises(UsageError, match="target_length"):
        ls.SearchSettings(train_length=64, target_length=32)
    with pytest.raises(UsageError, match="start_tokens"):
        ls.SearchSettings(train_length=16, target_length=64, start_tokens=(16,))
    with pytest.raises(UsageError, match="parents"):
        ls.SearchSettings(train_length=16, target_length=64, population=2, parents=3)


def test_search_takes_a_transformers_model_through_posenc_hf(valid):
    transformers = pytest.importorskip("transformers")
    import posenc.hf as ph

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                      vocab_size=256, max_position_embeddings=T)
    model = ph.use(transformers.LlamaForCausalLM(config).eval(), "rope")
    result = ls.search(model, valid, settings(generations=1, population=4, parents=2, mutations=2, crossovers=1))
    assert len(result.evaluated) >= 4 and result.block()["rope_type"] == "longrope"
    enc = model.model.posenc_encodings[0]
    assert enc.scaling.rope_type == "default"  # every individual's scaling undone
    # the PI seed's fitness is the model under PI itself
    from posenc.study.hf_evaluation import evaluate

    enc.set_scaling({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
                     "original_max_position_embeddings": T, "factor": 4.0,
                     "attention_factor": math.sqrt(1 + math.log(4) / math.log(T))})
    ppl = evaluate(model, valid[: 2 * TARGET + 1], [TARGET])[TARGET]["perplexity"]
    assert result.baselines["pi"] == pytest.approx(ppl, rel=1e-9)


def test_a_kept_individual_whose_perplexity_was_not_finite_resumes_as_infinite(model, valid, tmp_path, monkeypatch):
    """A state holding null perplexities (the model's was not finite) resumes without float(None), and
    an edited state with a negative perplexity is refused (issue 48, items 15 and 27)."""
    state = tmp_path / "state.json"
    original = ls._Search._perplexity
    calls = {"n": 0}

    def some_nan(self):
        calls["n"] += 1
        return math.nan if calls["n"] % 2 else original(self)

    monkeypatch.setattr(ls._Search, "_perplexity", some_nan)
    ls.search(model, valid, settings(generations=1), state=state)
    saved = json.loads(state.read_text())
    assert any(r["perplexity"] is None for r in saved["evaluated"])
    monkeypatch.setattr(ls._Search, "_perplexity", original)
    result = ls.search(model, valid, settings(generations=1), state=state, resume=True)
    assert math.isfinite(result.perplexity)
    saved["evaluated"][0]["perplexity"] = -3.0
    state.write_text(json.dumps(saved))
    with pytest.raises(UsageError, match="perplexity"):
        ls.search(model, valid, settings(generations=1), state=state, resume=True)


@pytest.mark.parametrize("stop", [12, 17])
def test_a_search_interrupted_in_a_later_generation_resumes_to_the_unbroken_search(model, valid, tmp_path, monkeypatch, stop):
    """Interrupted after ``stop`` evaluations (in generation 2 or 3 of 3), the resumed search evaluates
    exactly the individuals of an unbroken one, in its order, and ends with its factors: a resumed
    generation draws against what was evaluated before it, not against the killed run's later
    generations (issue 48, item 6: 25 evaluations instead of 24)."""
    unbroken = ls.search(model, valid, settings(generations=3))
    assert len(unbroken.evaluated) > stop and unbroken.evaluated[stop - 1]["generation"] >= 1
    state = tmp_path / "state.json"
    original = ls._Search._perplexity
    calls = {"n": 0}

    def killed(self):
        calls["n"] += 1
        if calls["n"] > stop:
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(ls._Search, "_perplexity", killed)
    with pytest.raises(KeyboardInterrupt):
        ls.search(model, valid, settings(generations=3), state=state)
    monkeypatch.setattr(ls._Search, "_perplexity", original)
    assert len(json.loads(state.read_text())["evaluated"]) == stop
    resumed = ls.search(model, valid, settings(generations=3), state=state, resume=True)

    def trail(result):
        return [(r["factors"], r["start"], r["generation"]) for r in result.evaluated]

    assert trail(resumed) == trail(unbroken)
    assert resumed.best == unbroken.best and resumed.perplexity == unbroken.perplexity


def test_a_state_without_an_individuals_generation_is_refused(model, valid, tmp_path):
    state = tmp_path / "state.json"
    ls.search(model, valid, settings(generations=1), state=state)
    saved = json.loads(state.read_text())
    del saved["evaluated"][2]["generation"]
    state.write_text(json.dumps(saved))
    with pytest.raises(UsageError, match="generation"):
        ls.search(model, valid, settings(generations=1), state=state, resume=True)
