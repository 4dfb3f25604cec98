"""Randomized positions (Ruoss et al. 2023) in ``posenc.LM``: what is drawn, when, and that training
with them runs for every method."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import posenc
from models import tiny_lm
from posenc import backends
from posenc.errors import UsageError


def randomized_lm(method: str = "alibi", random_positions: int | None = 64, **config) -> posenc.LM:
    """Positions at their init: these tests read which positions are drawn, not their effect."""
    options = {"max_positions": 64} if method == "learned" else {}
    return tiny_lm(method, vocab_size=32, dim=16, num_heads=2, positions_std=None,
                    random_positions=random_positions, **options, **config)


def spy_positions(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(query positions, key positions) of every attention call."""
    seen = []
    original = backends.choose

    def choose(name, spec, q):
        seen.append((spec.q_positions, spec.k_positions))
        return original(name, spec, q)

    monkeypatch.setattr(backends, "choose", choose)
    return seen


def test_drawn_positions_are_sorted_distinct_in_range_and_shared(monkeypatch):
    model = randomized_lm().train()
    seen = spy_positions(monkeypatch)
    model(torch.randint(0, 32, (3, 20)))
    assert len(seen) == 2  # one per layer
    q_positions, k_positions = seen[0]
    assert torch.equal(q_positions, k_positions)  # queries and keys: one set
    assert all(torch.equal(q, q_positions) and torch.equal(k, q_positions) for q, k in seen)  # every layer
    assert q_positions.shape == (20,) and q_positions.dtype == torch.long
    assert (q_positions[1:] > q_positions[:-1]).all()  # sorted, distinct
    assert int(q_positions.min()) >= 0 and int(q_positions.max()) < 64
    assert not torch.equal(q_positions, torch.arange(20))  # (1 chance in C(64, 20) to be consecutive)


def test_a_new_draw_every_forward_and_repeatable_under_a_seed(monkeypatch):
    model = randomized_lm().train()
    seen = spy_positions(monkeypatch)
    tokens = torch.randint(0, 32, (1, 12))
    torch.manual_seed(7)
    model(tokens)
    model(tokens)
    torch.manual_seed(7)
    model(tokens)
    first, second, again = seen[0][0], seen[2][0], seen[4][0]
    assert not torch.equal(first, second)
    assert torch.equal(first, again)


def test_off_in_eval_mode_and_when_not_configured(monkeypatch):
    seen = spy_positions(monkeypatch)
    with torch.no_grad():
        randomized_lm().eval()(torch.randint(0, 32, (1, 10)))
        randomized_lm(random_positions=None).train()(torch.randint(0, 32, (1, 10)))
    assert all(torch.equal(q, torch.arange(10)) for q, _ in seen)


def test_given_positions_are_used_in_eval_mode(monkeypatch):
    model = randomized_lm().eval()
    seen = spy_positions(monkeypatch)
    positions = torch.tensor([0, 5, 9, 30, 31, 63])
    with torch.no_grad():
        model(torch.randint(0, 32, (1, 6)), positions=positions)
    assert torch.equal(seen[0][0], positions)
    with pytest.raises(UsageError, match="positions must be >= 0"):
        model(torch.randint(0, 32, (1, 3)), positions=torch.tensor([3, -2, 1]))


def test_draws_do_change_the_result():
    model = randomized_lm("alibi").train()
    tokens = torch.randint(0, 32, (1, 16))
    torch.manual_seed(1)
    a = model(tokens)
    torch.manual_seed(2)
    b = model(tokens)
    assert not torch.allclose(a, b)


def test_decoding_with_a_cache_keeps_plain_positions():
    """A KV cache needs consecutive positions: a cached call never draws (even in training mode)."""
    model = randomized_lm().train()
    cache = model.new_cache(1)
    with torch.no_grad():
        model(torch.randint(0, 32, (1, 5)), cache=cache)
        model(torch.randint(0, 32, (1, 2)), cache=cache)
    assert cache.length == 7


@pytest.mark.parametrize("method", posenc.available())
def test_training_with_random_positions_runs_for_every_method(method):
    model = randomized_lm(method).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, 32, (2, 24))
    loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    # the steps-of-one fast paths step aside (remapped finds its intervals by bisection)
    assert model.blocks[0].attn.last_backend in ("sdpa", "eager", "remapped")


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: posenc.LMConfig(encoding="alibi", random_positions=0), r"random_positions must be a positive integer \(>= 1\), got 0"),
        (lambda: posenc.LM(posenc.LMConfig(encoding="learned", max_positions=32, random_positions=64)),
         r"random_positions \(64\) must be <= max_positions \(32\) of encoding 'learned'"),
        (lambda: randomized_lm(random_positions=8).train()(torch.zeros(1, 9, dtype=torch.long)),
         r"random_positions \(8\) must be >= the sequence length \(9\)"),
        (lambda: randomized_lm(random_positions=None).draw_positions(4), "needs LMConfig\\(random_positions=...\\)"),
    ],
)
def test_mistakes_are_usage_errors_naming_the_option(make, message):
    with pytest.raises(UsageError, match=message):
        make()


def test_learned_positions_accept_a_large_enough_table():
    """random_positions equal to the table's size: every drawn position is a row of the table, and
    training runs (finite logits whose gradient reaches the rows drawn, and only them)."""
    model = posenc.LM(posenc.LMConfig(encoding="learned", max_positions=64, random_positions=64)).train()
    torch.manual_seed(3)
    drawn = model.draw_positions(16)
    assert drawn.min() >= 0 and drawn.max() < 64 and len(set(drawn.tolist())) == 16
    torch.manual_seed(3)  # the forward draws the same positions from the same generator state
    logits = model(torch.randint(0, 256, (1, 16)))
    assert logits.shape == (1, 16, model.config.vocab_size) and torch.isfinite(logits).all()
    logits.square().mean().backward()
    table = next(p for p in model.parameters() if p.shape[0] == 64 and p.grad is not None)
    assert torch.isfinite(table.grad).all() and (table.grad != 0).any(dim=-1).sum() <= 16
