"""Generation: prompts in, new tokens out, one token at a time through the KV cache.

    new = model.generate([prompt_a, prompt_b], max_new_tokens=64, temperature=0.8, top_p=0.95, seed=0)

Batches. Prompts of different lengths are left-padded to the longest and decoded together: row b's
real tokens start at its padding, and the padding keys are hidden from its real tokens (the cache's
``padding``, :class:`posenc.cache.Cache`). That gives each row exactly what it gets alone when the
encoding is ``shift_invariant`` (positions enter only as i - j: NoPE, ALiBi, T5, RoPE, Shaw,
Transformer-XL) or has no hook but ``embed`` (sinusoidal, learned: ``embed`` gets each row's own
positions). For any other encoding (one whose attention reads absolute positions, or a rotation
that depends on the current length) rows that share a position frame would not get what they get
alone, so :func:`stream` falls back to one batch per prompt length (rows of equal length need no
padding) and runs those batches in lockstep. Exact here means the same computation up to float
rounding: a row decoded among others may see its positions shifted by its padding.

Sampling. ``temperature == 0`` is greedy (argmax). Otherwise the logits are divided by the
temperature, then optionally cut to the ``top_k`` largest and to the nucleus of probability
``top_p`` (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration", §3.1: the smallest
set of most likely tokens whose mass reaches p), and a token is drawn. Each row draws from its own
``torch.Generator`` seeded with ``seed + row``, so a row's tokens repeat exactly for the same seed
and do not depend on the other rows of the batch.

Shape legend: B rows, T prompt length, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import torch
from torch import nn

from .encodings.protocol import Biases, QueryTerms, Rotates, Scores, ValueTerms, offers
from .errors import UsageError

ATTENTION_HOOKS = (Rotates, Biases, Scores, QueryTerms, ValueTerms)


@dataclass(frozen=True)
class Step:
    """One step of :func:`stream`: every row's new token."""

    tokens: torch.Tensor  # (B,) the token each row got
    logits: torch.Tensor  # (B, V) the model's logits it was chosen from (before temperature and cuts)
    done: torch.Tensor  # (B,) bool: the row has produced a stop token, at this step or before


def shares_positions(encoding: nn.Module) -> bool:
    """Whether left-padded rows may share positions (see the module docstring)."""
    if getattr(encoding, "rotation_depends_on_length", False):
        return False
    return bool(getattr(encoding, "shift_invariant", False)) or not any(offers(encoding, h) for h in ATTENTION_HOOKS)


def prompts_of(prompt, vocab_size: int) -> list[torch.Tensor]:
    """A (B, T) integer tensor or a sequence of 1-D integer tensors (or lists of ints), as B 1-D tensors."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 2:
            raise UsageError(f"prompt must be a (batch, length) tensor or a list of 1-D tensors, got shape {tuple(prompt.shape)}")
        rows = list(prompt)
    elif isinstance(prompt, (list, tuple)):
        rows = [torch.as_tensor(p) for p in prompt]
    else:
        raise UsageError(f"prompt must be a (batch, length) tensor or a list of 1-D tensors, got {type(prompt).__name__}")
    if not rows:
        raise UsageError("prompt must hold at least one row")
    for n, row in enumerate(rows):
        if row.dim() != 1 or row.is_floating_point() or row.is_complex() or row.dtype == torch.bool:
            raise UsageError(f"prompt row {n} must be a 1-D tensor of integer token ids, got {row.dtype} of shape {tuple(row.shape)}")
        if row.numel() == 0:
            raise UsageError(f"prompt row {n} is empty: every prompt needs at least one token")
        if int(row.min()) < 0 or int(row.max()) >= vocab_size:
            raise UsageError(f"prompt row {n}: token ids must be in [0, vocab_size={vocab_size}), got [{int(row.min())}, {int(row.max())}]")
    return [row.long() for row in rows]


def check_sampling(max_new_tokens, temperature, top_k, top_p, seed) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise UsageError(f"max_new_tokens must be a positive integer (>= 1), got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise UsageError(f"temperature must be a number >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise UsageError(f"top_k must be a positive integer (>= 1) or None, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise UsageError(f"top_p must be in (0, 1] or None, got {top_p!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise UsageError(f"seed must be an integer >= 0 or None, got {seed!r}")


def filter_logits(logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """logits (B, V) with -inf outside the ``top_k`` largest and outside the nucleus ``top_p``."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above each one
        drop = before >= top_p  # the most likely token is always kept (nothing ranks above it)
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def choose(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
           generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row (B,): argmax when temperature is 0, else a draw from each row's generator."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(filter_logits(logits.float() / temperature, top_k, top_p), dim=-1)  # (B, V)
    return torch.cat([torch.multinomial(probs[b], 1, generator=g) for b, g in enumerate(generators)])


class _Group:
    """Rows decoded together in one KV cache (all rows, or the rows of one prompt length)."""

    def __init__(self, model: nn.Module, rows: list[int], prompts: list[torch.Tensor], extra: int) -> None:
        self.model, self.rows = model, rows
        length = max(prompts[r].numel() for r in rows)
        padding = [length - prompts[r].numel() for r in rows]
        tokens = torch.zeros(len(rows), length, dtype=torch.long, device=prompts[rows[0]].device)  # (G, T), left-padded
        for n, r in enumerate(rows):
            tokens[n, padding[n]:] = prompts[r]
        self.cache = model.new_cache(len(rows), capacity=length + extra, padding=padding)
        self.logits = self._forward(tokens)

    def _forward(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(tokens, cache=self.cache)[:, -1].float()  # (G, V)

    def feed(self, tokens: torch.Tensor) -> None:
        self.logits = self._forward(tokens[self.rows][:, None])


def stream(model: nn.Module, prompt, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
           top_p: float | None = None, seed: int | None = None, stop_tokens: Iterable[int] | None = None) -> Iterator[Step]:
    """Decode ``max_new_tokens`` tokens after each prompt, yielding every step as it comes.

    Args:
        model: a causal :class:`posenc.LM`.
        prompt: (B, T) token ids, or B 1-D tensors of different lengths.
        max_new_tokens: tokens to generate per row (fewer when every row has stopped).
        temperature: 0 for greedy decoding; otherwise the softmax temperature.
        top_k: keep only the k most likely tokens (None: all).
        top_p: keep only the nucleus of this probability mass, in (0, 1] (None: all).
        seed: row b draws from a generator seeded with seed + b (None: a random seed).
        stop_tokens: a row stops after producing one of these.
    """
    config = model.config
    check_sampling(max_new_tokens, temperature, top_k, top_p, seed)
    prompts = prompts_of(prompt, config.vocab_size)
    stops = set() if stop_tokens is None else {int(t) for t in stop_tokens}
    if any(not 0 <= t < config.vocab_size for t in stops):
        raise UsageError(f"stop_tokens must be ids in [0, vocab_size={config.vocab_size}), got {sorted(stops)}")
    longest = max(p.numel() for p in prompts)
    if model.max_length is not None and longest + max_new_tokens > model.max_length:
        if longest > model.max_length:
            raise UsageError(f"prompt has {longest} tokens, more than the model's learned positions (max_positions={model.max_length})")
        raise UsageError(
            f"max_new_tokens must be <= {model.max_length - longest} here: the model has max_positions={model.max_length} "
            f"learned positions and the prompt has {longest} tokens"
        )
    device = next(model.parameters()).device
    prompts = [p.to(device) for p in prompts]
    b = len(prompts)
    if shares_positions(model.encoding):
        groups = [_Group(model, list(range(b)), prompts, max_new_tokens)]
    else:  # one batch per prompt length: no padding, no shared position frame
        lengths = sorted({p.numel() for p in prompts})
        groups = [_Group(model, [r for r in range(b) if prompts[r].numel() == n], prompts, max_new_tokens) for n in lengths]
    generators: list[torch.Generator | None] = [None] * b
    if temperature != 0:
        generators = [torch.Generator(device=device) for _ in range(b)]
        for row, g in enumerate(generators):
            if seed is None:
                g.seed()  # a fresh random seed
            else:
                g.manual_seed(seed + row)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    stop_ids = torch.tensor(sorted(stops), dtype=torch.long, device=device)
    for step in range(max_new_tokens):
        logits = torch.empty(b, config.vocab_size, device=device)  # (B, V)
        tokens = torch.empty(b, dtype=torch.long, device=device)  # (B,)
        for group in groups:
            logits[group.rows] = group.logits
            tokens[group.rows] = choose(group.logits, temperature, top_k, top_p, [generators[r] for r in group.rows])
        done = done | torch.isin(tokens, stop_ids)
        yield Step(tokens, logits, done.clone())
        if step + 1 == max_new_tokens or bool(done.all()):
            return
        for group in groups:
            group.feed(tokens)


def generate(model: nn.Module, prompt, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None, stop_tokens: Iterable[int] | None = None) -> list[torch.Tensor]:
    """The new tokens of every row, a 1-D tensor each (up to and including its first stop token).

    Arguments as :func:`stream`.
    """
    steps = list(stream(model, prompt, max_new_tokens, temperature, top_k, top_p, seed, stop_tokens))
    tokens = torch.stack([s.tokens for s in steps], dim=1)  # (B, steps)
    if stop_tokens is None:
        return list(tokens)
    out = []
    for row in range(tokens.shape[0]):
        stopped = [n for n, s in enumerate(steps) if bool(s.done[row])]
        out.append(tokens[row, : stopped[0] + 1] if stopped else tokens[row])
    return out


__all__ = ["Step", "check_sampling", "choose", "filter_logits", "generate", "prompts_of", "shares_positions", "stream"]
