"""Generation: prompts in, tokens out, one token at a time through the KV cache, with the argument
names and return convention of Hugging Face ``transformers``' ``generate``.

    out = model.generate(input_ids, max_new_tokens=64)                            # greedy
    out = model.generate(input_ids, max_new_tokens=64, do_sample=True, temperature=0.8, top_p=0.95, seed=0,
                         eos_token_id=10, pad_token_id=0)

What comes back: a (B * num_return_sequences, T + n) LongTensor, each row its prompt (as given,
left padding included) followed by its new tokens; ``n <= max_new_tokens`` is the number of steps
run (fewer when every row has produced an end token). A row that has produced one of
``eos_token_id`` keeps it, and every position after it holds ``pad_token_id``. :func:`stream`
yields the same steps one at a time.

Defaults, as in ``transformers``: greedy decoding (``do_sample=False``; ``temperature``, ``top_k``
and ``top_p`` are used only when sampling); ``pad_token_id`` defaults to the first
``eos_token_id`` (and to 0 when there is none: then no row stops early, and 0 only pads prompts of
different lengths given as a list). One deliberate difference: sampling draws from one
``torch.Generator`` per output row, seeded with ``seed + row`` (``seed=None``: seeds drawn from
torch's global generator, so ``torch.manual_seed`` repeats a call), which makes a row's tokens
independent of the other rows of the batch: row b of a batch is what its prompt alone gives with
``seed + b``. ``transformers`` draws the whole batch from the global generator.

Prompts: a (B, T) tensor, with ``attention_mask`` (B, T) of 1 (real token) and 0 (padding) for
left-padded rows (the padding must come first); or B 1-D tensors (or lists of ids) of different
lengths, which are left-padded here with ``pad_token_id``.

Batches. Rows of different lengths are decoded together left-padded: row b's real tokens start at
its padding, and the padding keys are hidden from its real tokens (the cache's ``padding``,
:class:`posenc.model.cache.Cache`). That gives each row exactly what it gets alone when the encoding is
``shift_invariant`` (positions enter only as i - j: NoPE, ALiBi, T5, RoPE, Shaw, Transformer-XL) or
has no hook but ``embed`` (sinusoidal, learned: ``embed`` gets each row's own positions). For any
other encoding (one whose attention reads absolute positions, or a rotation that depends on the
current length) rows that share a position frame would not get what they get alone, so
:func:`stream` falls back to one batch per prompt length (rows of equal length need no padding)
and runs those batches in lockstep. Exact here means the same computation up to float rounding.

The KV cache grows as generation goes (doubling, :class:`posenc.model.cache.LayerCache`): nothing is
reserved for ``max_new_tokens`` in advance, so "run until the end token" with a large
``max_new_tokens`` costs only the tokens actually generated.

Sampling: the logits are divided by the temperature (after subtracting each row's largest, so that
any temperature > 0 gives finite probabilities), then optionally cut to the ``top_k`` largest and to
the nucleus of probability ``top_p`` (Holtzman et al. 2020, "The Curious Case of Neural Text
Degeneration", §3.1: the smallest set of most likely tokens whose mass reaches p), and a token is
drawn.

Shape legend: B rows, T prompt length, V vocabulary.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Protocol, Sequence

import torch
from torch import nn

from ..encodings.protocol import HOOKS, Embeds, Gates, Scores, offers
from ..errors import UsageError

if TYPE_CHECKING:  # names for the type checker only
    from .cache import Cache
    from .schedule import Schedule


class _Sizes(Protocol):
    """What generation reads of a model's config (:class:`posenc.LMConfig` has both)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def layers(self) -> Schedule | None: ...


class CausalLM(Protocol):
    """What generation needs of a model: :class:`posenc.LM` is one. Generation is written against
    this rather than the class, so that the model module can offer ``LM.generate`` without the two
    modules importing each other."""

    @property
    def config(self) -> _Sizes: ...

    @property
    def encoding(self) -> nn.Module: ...

    @property
    def max_length(self) -> int | None: ...

    def new_cache(self, batch_size: int, capacity: int | None = None, padding: Any = None) -> Cache: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def __call__(self, tokens: torch.Tensor, *, cache: Cache | None = None) -> torch.Tensor: ...

# Where positions enter the attention: every hook of the protocol but ``embed`` (it takes each
# row's own positions) and ``log_gates`` (no positions at all), and a bias's elementwise ``score``.
ATTENTION_HOOKS = (*(h for h in HOOKS if h not in (Embeds, Gates)), Scores)
SEED_RANGE = 2**64  # torch.Generator.manual_seed accepts [0, 2**64); seed + row wraps around it


@dataclass(frozen=True)
class Step:
    """One step of :func:`stream`: every row's new token."""

    tokens: torch.Tensor  # (B,) the token each row got (pad_token_id for a row that was already done)
    logits: torch.Tensor  # (B, V) the model's logits it was chosen from (before temperature and cuts)
    done: torch.Tensor  # (B,) bool: the row has produced an end token, at this step or before


def shares_positions(encoding: nn.Module) -> bool:
    """Whether left-padded rows may share positions (see the module docstring)."""
    if getattr(encoding, "rotation_depends_on_length", False):
        return False
    return bool(getattr(encoding, "shift_invariant", False)) or not any(offers(encoding, h) for h in ATTENTION_HOOKS)


def _token_id(name: str, value, vocab_size: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= int(value) < vocab_size:
        raise UsageError(f"{name} must be a token id, an integer in [0, vocab_size={vocab_size}), got {value!r}")
    return int(value)


def token_ids(name: str, value, vocab_size: int) -> list[int]:
    """``eos_token_id``: None, an id, or a list / tuple / 1-D tensor of ids, as a list of ints."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        if value.dim() > 1 or value.is_floating_point() or value.dtype == torch.bool:
            raise UsageError(f"{name} must be an integer token id or a list of them, got a {value.dtype} tensor of "
                             f"shape {tuple(value.shape)}")
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        if not value:
            raise UsageError(f"{name} must be an integer token id or a non-empty list of them, got {value!r}")
        return [_token_id(name, v, vocab_size) for v in value]
    return [_token_id(name, value, vocab_size)]


def prompts_of(prompt, vocab_size: int, attention_mask=None) -> list[torch.Tensor]:
    """The real tokens of every row as B 1-D LongTensors: from a (B, T) tensor (``attention_mask``
    (B, T) marking the real tokens of left-padded rows), or from B 1-D tensors or lists of ints."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 2:
            raise UsageError(f"prompt must be a (batch, length) tensor or a list of 1-D tensors, got shape {tuple(prompt.shape)}")
        rows = list(prompt)
        if attention_mask is not None:
            rows = _unpadded(prompt, attention_mask)
    elif isinstance(prompt, (list, tuple)):
        if attention_mask is not None:
            raise UsageError("attention_mask goes with a (batch, length) prompt tensor; a list of prompts needs none "
                             "(each row is its own length)")
        rows = []
        for n, p in enumerate(prompt):
            try:
                rows.append(torch.as_tensor(p))
            except (TypeError, ValueError, RuntimeError):
                raise UsageError(f"prompt row {n} must be a 1-D tensor of integer token ids, got {p!r}") from None
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


def _unpadded(prompt: torch.Tensor, mask) -> list[torch.Tensor]:
    """Each row's real tokens, from a left-padding ``attention_mask`` (zeros, then ones)."""
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(prompt.shape):
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise UsageError(f"attention_mask must be a tensor of the prompt's shape {tuple(prompt.shape)}, got {shape}")
    m = mask.to(device=prompt.device)
    if not bool(((m == 0) | (m == 1)).all()):
        raise UsageError("attention_mask must hold only 0 (padding) and 1 (a real token)")
    m = m.bool()
    rows = []
    for n in range(prompt.shape[0]):
        real = int(m[n].sum())
        if real == 0:
            raise UsageError(f"attention_mask row {n} is all padding: every prompt needs at least one token")
        if not bool(m[n, prompt.shape[1] - real:].all()):
            raise UsageError(f"attention_mask row {n} is not left padding (zeros first, then ones): generation continues "
                             "after the last token, so padding must come before the prompt")
        rows.append(prompt[n, prompt.shape[1] - real:])
    return rows


def check_sampling(max_new_tokens, temperature, top_k, top_p, seed, do_sample: bool = True,
                   num_return_sequences: int = 1) -> None:
    """UsageError naming the argument for any unusable value (before any model work)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise UsageError(f"max_new_tokens must be a positive integer (>= 1), got {max_new_tokens!r}")
    if not isinstance(do_sample, bool):
        raise UsageError(f"do_sample must be True or False, got {do_sample!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not math.isfinite(temperature) \
            or not float(temperature) > 0:
        why = " (greedy decoding is do_sample=False)" if isinstance(temperature, numbers.Real) and temperature == 0 else ""
        raise UsageError(f"temperature must be a finite number > 0{why}, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise UsageError(f"top_k must be a positive integer (>= 1) or None, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < float(top_p) <= 1):
        raise UsageError(f"top_p must be in (0, 1] or None, got {top_p!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_RANGE):
        raise UsageError(f"seed must be an integer in [0, 2**64 - 1] or None, got {seed!r}")
    if isinstance(num_return_sequences, bool) or not isinstance(num_return_sequences, int) or num_return_sequences < 1:
        raise UsageError(f"num_return_sequences must be a positive integer (>= 1), got {num_return_sequences!r}")
    if num_return_sequences > 1 and not do_sample:
        raise UsageError(f"num_return_sequences={num_return_sequences} needs do_sample=True: greedy decoding would "
                         "return the same sequence every time")


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


def choose(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int | None, top_p: float | None,
           generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row (B,): the argmax without sampling, else a draw from each row's generator."""
    if not do_sample:
        return logits.argmax(dim=-1)
    logits = logits.float()
    # Shift first: the largest becomes 0, the others -d / T, at worst -inf; never inf - inf, so even
    # a temperature of 1e-45 gives finite probabilities (all mass on the largest).
    scaled = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    probs = torch.softmax(filter_logits(scaled, top_k, top_p), dim=-1)  # (B, V)
    return torch.cat([torch.multinomial(probs[b], 1, generator=g) for b, g in enumerate(generators)])


class _Group:
    """Rows decoded together in one KV cache (all rows, or the rows of one prompt length)."""

    def __init__(self, model: CausalLM, rows: list[int], prompts: list[torch.Tensor]) -> None:
        self.model, self.rows = model, rows
        length = max(prompts[r].numel() for r in rows)
        padding = [length - prompts[r].numel() for r in rows]
        tokens = torch.zeros(len(rows), length, dtype=torch.long, device=prompts[rows[0]].device)  # (G, T), left-padded
        for n, r in enumerate(rows):
            tokens[n, padding[n]:] = prompts[r]
        # No capacity: the cache holds the prompt and doubles as tokens come (nothing reserved ahead).
        self.cache = model.new_cache(len(rows), padding=padding)
        self.logits = self._forward(tokens)

    def _forward(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(tokens, cache=self.cache)[:, -1].float()  # (G, V)

    def feed(self, tokens: torch.Tensor) -> None:
        self.logits = self._forward(tokens[self.rows][:, None])


@dataclass(frozen=True)
class _Setup:
    prompts: list[torch.Tensor]  # each output row's real tokens (a prompt repeated num_return_sequences times)
    eos: list[int]
    pad: int
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    seed: int | None


def _setup(model: CausalLM, prompt, max_new_tokens, do_sample, temperature, top_k, top_p, seed, eos_token_id,
           pad_token_id, attention_mask, num_return_sequences) -> _Setup:
    config = model.config
    check_sampling(max_new_tokens, temperature, top_k, top_p, seed, do_sample, num_return_sequences)
    eos = token_ids("eos_token_id", eos_token_id, config.vocab_size)
    pad = eos[0] if pad_token_id is None and eos else (0 if pad_token_id is None else
                                                        _token_id("pad_token_id", pad_token_id, config.vocab_size))
    prompts = prompts_of(prompt, config.vocab_size, attention_mask)
    longest = max(p.numel() for p in prompts)
    limit = model.max_length
    # The last new token is returned, never fed back: prompt + max_new_tokens - 1 positions are used.
    if limit is not None and longest + max_new_tokens - 1 > limit:
        if longest > limit:
            raise UsageError(f"prompt has {longest} tokens, more than the model's learned positions (max_positions={limit})")
        raise UsageError(
            f"max_new_tokens must be <= {limit - longest + 1} here: the model has max_positions={limit} learned "
            f"positions and the prompt has {longest} tokens (the last new token is not fed back)"
        )
    device = next(model.parameters()).device
    prompts = [p.to(device) for p in prompts for _ in range(num_return_sequences)]  # rows b*n .. b*n + n - 1
    return _Setup(prompts, eos, pad, do_sample, float(temperature), top_k, top_p, seed)


def stream(model: CausalLM, prompt, max_new_tokens: int, *, do_sample: bool = False, temperature: float = 1.0,
           top_k: int | None = None, top_p: float | None = None, seed: int | None = None, eos_token_id=None,
           pad_token_id: int | None = None, attention_mask: torch.Tensor | None = None,
           num_return_sequences: int = 1) -> Iterator[Step]:
    """Decode up to ``max_new_tokens`` tokens after each prompt, yielding every step as it comes.

    Args: as :func:`generate`. Each :class:`Step` holds one token per output row (a row already
    done gets ``pad_token_id``), the logits it was chosen from and which rows are done; the
    stream ends after ``max_new_tokens`` steps or when every row is done.
    """
    setup = _setup(model, prompt, max_new_tokens, do_sample, temperature, top_k, top_p, seed, eos_token_id,
                   pad_token_id, attention_mask, num_return_sequences)
    yield from _steps(model, setup, max_new_tokens)


def _steps(model: CausalLM, setup: _Setup, max_new_tokens: int) -> Iterator[Step]:
    prompts = setup.prompts
    b, vocab = len(prompts), model.config.vocab_size
    device = prompts[0].device
    if shares_positions(model.encoding) and (model.config.layers is None or model.config.layers.shift_invariant):
        groups = [_Group(model, list(range(b)), prompts)]
    else:  # one batch per prompt length: no padding, no shared position frame
        lengths = sorted({p.numel() for p in prompts})
        groups = [_Group(model, [r for r in range(b) if prompts[r].numel() == n], prompts) for n in lengths]
    generators: list[torch.Generator | None] = [None] * b
    if setup.do_sample:
        first = setup.seed if setup.seed is not None else int(torch.randint(0, 2**63 - 1, ()))  # global RNG
        generators = [torch.Generator(device=device).manual_seed((first + row) % SEED_RANGE) for row in range(b)]
    done = torch.zeros(b, dtype=torch.bool, device=device)
    eos = torch.tensor(setup.eos, dtype=torch.long, device=device)
    for step in range(max_new_tokens):
        logits = torch.empty(b, vocab, device=device)  # (B, V)
        tokens = torch.empty(b, dtype=torch.long, device=device)  # (B,)
        for group in groups:
            logits[group.rows] = group.logits
            tokens[group.rows] = choose(group.logits, setup.do_sample, setup.temperature, setup.top_k, setup.top_p,
                                        [generators[r] for r in group.rows])
        tokens = torch.where(done, setup.pad, tokens)  # a finished row pads
        done = done | torch.isin(tokens, eos)
        yield Step(tokens, logits, done.clone())
        if step + 1 == max_new_tokens or bool(done.all()):
            return
        for group in groups:
            group.feed(tokens)


def generate(model: CausalLM, prompt, max_new_tokens: int, *, do_sample: bool = False, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None, eos_token_id=None,
             pad_token_id: int | None = None, attention_mask: torch.Tensor | None = None,
             num_return_sequences: int = 1) -> torch.Tensor:
    """Prompts and their continuations, as ``transformers``' ``generate`` returns them.

    Args:
        model: a causal :class:`posenc.LM`.
        prompt: (B, T) token ids (``input_ids``), or B 1-D tensors (or lists of ids) of different lengths.
        max_new_tokens: the most tokens to generate per row (fewer when every row is done).
        do_sample: False (default): greedy, the argmax; True: sample with the options below.
        temperature: softmax temperature when sampling, finite and > 0.
        top_k: when sampling, keep only the k most likely tokens (None: all).
        top_p: when sampling, keep only the nucleus of this probability mass, in (0, 1] (None: all).
        seed: output row r draws from a generator seeded with seed + r (None: from torch's global RNG).
        eos_token_id: an id or a list of ids; a row is done once it produces one.
        pad_token_id: fills a row after its end token, and left-pads list prompts (default: the
            first eos_token_id, else 0).
        attention_mask: (B, T), 1 for real tokens and 0 for the left padding of ``prompt``.
        num_return_sequences: sequences per prompt (needs do_sample); prompt b's are rows b*n .. b*n+n-1.

    Returns:
        (B * num_return_sequences, T + n) LongTensor: the prompt (a list of prompts left-padded
        with ``pad_token_id``; a tensor as given) then n <= max_new_tokens new tokens, each row
        padded with ``pad_token_id`` after its end token.

    Raises:
        UsageError: an option outside the range given above (naming it), token ids outside the
            vocabulary, a prompt and mask that do not fit, or a prompt plus ``max_new_tokens``
            longer than a bounded encoding's ``max_positions``.
    """
    setup = _setup(model, prompt, max_new_tokens, do_sample, temperature, top_k, top_p, seed, eos_token_id,
                   pad_token_id, attention_mask, num_return_sequences)
    new = torch.stack([s.tokens for s in _steps(model, setup, max_new_tokens)], dim=1)  # (B*n, steps)
    if isinstance(prompt, torch.Tensor):
        given = prompt.to(new.device).long().repeat_interleave(num_return_sequences, dim=0)  # (B*n, T)
    else:
        length = max(p.numel() for p in setup.prompts)
        given = torch.full((len(setup.prompts), length), setup.pad, dtype=torch.long, device=new.device)
        for r, p in enumerate(setup.prompts):
            given[r, length - p.numel():] = p
    return torch.cat((given, new), dim=1)


__all__ = ["Step", "check_sampling", "choose", "filter_logits", "generate", "prompts_of", "shares_positions", "stream",
           "token_ids"]
