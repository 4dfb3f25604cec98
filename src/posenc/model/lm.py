"""A small Transformer language model around the attention: decoder (causal) or encoder.

nanoGPT-shaped: pre-LayerNorm blocks, GELU MLP, token embedding tied to the output head. Positions
come only from the encoding: ``embed`` once on the input, the other hooks inside each attention.
Encodings with ``shares_across_layers`` are built once and used by every layer (T5's bias table,
and the parameter-free methods); the others get one instance per layer.

Randomized positions (Ruoss et al. 2023, "Randomized Positional Encodings Boost Length
Generalization of Transformers"): with ``LMConfig(random_positions=L)``, every training forward
(``model.train()``, no KV cache) draws a sorted set of T distinct positions from [0, L) for its T
tokens, one set for the whole batch and for queries and keys alike, so a model trained on short
sequences has seen the positions of long ones. Evaluation uses 0..T-1 unless ``positions`` is given.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .. import backends
from ..call.axes import check_takes_axes
from ..call.geometry import Geometry
from ..call.memo import ForwardMemo
from ..encodings import PositionalEncoding, available, build, get_class, options_of
from ..encodings.base import position_axes_of
from ..encodings.protocol import Embeds, offers
from ..errors import UsageError, check_positive
from . import generate as generation
from .attention import Attention, key_padding_mask_of
from .cache import Cache, check_padding
from .schedule import Layer, Schedule


@dataclass
class LMConfig:
    """A small decoder (or encoder) LM around one encoding or a layer schedule, checked when made.

    Raises:
        UsageError: an unknown encoding or backend name, a size that is not a positive integer,
            ``dim`` not divisible by ``num_heads`` (or ``num_heads`` by ``num_kv_heads``),
            ``encoding_options`` or an absolute ``encoding`` (sinusoidal, learned: its input
            embedding would be dropped) given with a ``schedule``, or a schedule that does not
            parse or does not have ``depth`` layers.
    """

    encoding: str = "alibi"
    vocab_size: int = 256
    dim: int = 128
    depth: int = 4
    num_heads: int = 4
    max_positions: int | None = None  # table size for bounded methods (learned); None = default
    causal: bool = True
    encoding_options: dict = field(default_factory=dict)
    attention_backend: str = "auto"
    mlp_ratio: int = 4
    random_positions: int | None = None  # training draws positions from [0, random_positions); None = off
    num_kv_heads: int | None = None  # key/value heads (grouped-query attention); None = num_heads
    # Per layer encoding and attention kind (posenc.model.schedule): a text such as
    # "3x[rope:base=1e4 window=64] 1x[nope]" or the json list; kept as the json list. None: every
    # layer takes ``encoding`` with full attention. With a schedule, ``encoding`` is set to the
    # first layer's method (for code that reads one name) and ``encoding_options`` must be empty.
    schedule: str | list | None = None

    def __post_init__(self) -> None:
        if self.schedule is not None:
            if self.encoding in available() and offers(get_class(self.encoding), Embeds):
                raise UsageError(f"encoding={self.encoding!r} is an absolute method (it adds to the token embeddings), "
                                 "and a schedule gives every layer's encoding: the two do not combine; drop encoding, "
                                 "or the schedule")
            check_positive("depth", self.depth)
            if self.encoding_options:
                raise UsageError("encoding_options do not apply with a schedule: give each layer's options in the schedule")
            layers = Schedule.of(self.schedule, self.depth)
            self.schedule = layers.to_list()
            self.encoding = layers.layers[0].encoding
        get_class(self.encoding)  # unknown name -> ValueError listing the choices
        for name in ("vocab_size", "dim", "depth", "num_heads", "mlp_ratio"):
            check_positive(name, getattr(self, name))
        if self.dim % self.num_heads:
            raise UsageError(f"dim ({self.dim}) must be divisible by num_heads ({self.num_heads})")
        if self.max_positions is not None:
            check_positive("max_positions", self.max_positions)
        if self.random_positions is not None:
            check_positive("random_positions", self.random_positions)
        if self.num_kv_heads is not None:
            check_positive("num_kv_heads", self.num_kv_heads)
            if self.num_heads % self.num_kv_heads:
                raise UsageError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        backends.check_name(self.attention_backend)

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def layers(self) -> Schedule | None:
        """The parsed :class:`~posenc.model.schedule.Schedule`, or None without one."""
        return None if self.schedule is None else Schedule.of(self.schedule, self.depth)

    def to_dict(self) -> dict:
        return asdict(self)


def _scheduled_encodings(config: LMConfig, layers: Sequence[Layer]) -> list[PositionalEncoding]:
    """One encoding per layer; layers with the same method and options share one instance when the
    method shares across layers (T5's table, RoPE's cos/sin tables)."""
    shared: dict[str, PositionalEncoding] = {}
    out = []
    for layer in layers:
        cls = get_class(layer.encoding)
        options = dict(layer.options)
        if config.max_positions is not None and "max_positions" in options_of(cls):
            options.setdefault("max_positions", config.max_positions)
        key = layer.sharing_key
        if key in shared:  # only an encoding that shares across layers is kept there
            out.append(shared[key])
            continue
        enc = build(layer.encoding, num_heads=config.num_heads, head_dim=config.head_dim, causal=config.causal, **options)
        if enc.shares_across_layers:
            shared[key] = enc
        out.append(enc)
    return out


class MLP(nn.Module):
    def __init__(self, dim: int, ratio: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, ratio * dim)
        self.proj = nn.Linear(ratio * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, config: LMConfig, encoding: PositionalEncoding, layer: Layer | None = None) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.dim)
        self.attn = Attention(
            config.dim, config.num_heads, encoding, config.causal, config.attention_backend, config.num_kv_heads,
            window=None if layer is None else layer.window, chunk=None if layer is None else layer.chunk,
            sinks=False if layer is None else layer.sinks, query_scale=None if layer is None else layer.query_scale,
        )
        self.ln2 = nn.LayerNorm(config.dim)
        self.mlp = MLP(config.dim, config.mlp_ratio)

    def forward(self, x, positions, cache=None, memo=None, geometry=None):
        x = x + self.attn(self.ln1(x), positions, cache, memo, geometry=geometry)
        return x + self.mlp(self.ln2(x))


class LM(nn.Module):
    """tokens (B, T) -> logits (B, T, vocab). ``cache`` (from :meth:`new_cache`) decodes incrementally.

    Raises:
        UsageError: an encoding option its method rejects (naming it), or ``random_positions``
            past the encoding's ``max_positions``.
    """

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.config = config
        schedule = config.layers
        layers: Sequence[Layer | None]
        if schedule is not None:
            layers = schedule.layers
            encodings = _scheduled_encodings(config, schedule.layers)
        else:
            layers = (None,) * config.depth
            options = dict(config.encoding_options)
            cls = get_class(config.encoding)
            if config.max_positions is not None and "max_positions" in options_of(cls):
                options.setdefault("max_positions", config.max_positions)

            def make():
                return build(config.encoding, num_heads=config.num_heads, head_dim=config.head_dim, causal=config.causal, **options)

            first = make()
            encodings = [first] + [first if first.shares_across_layers else make() for _ in range(config.depth - 1)]
        self.encoding = encodings[0]  # the one whose embed() is applied to the input (none in a schedule)
        # The encoding whose position axes ``positions`` may carry: the first layer's with more
        # than one (M-RoPE, a patch grid), else the first layer's. Layers that read other axes
        # refuse positions with an axis dimension when they come (check_takes_axes).
        axes = {position_axes_of(enc) for enc in encodings if position_axes_of(enc)[0] > 1}
        if len({count for count, _ in axes}) > 1:
            raise UsageError(f"the layers' encodings read different numbers of position axes ({sorted(axes)}): "
                             "one model takes one kind of positions")
        self._position_layer = next((i for i, enc in enumerate(encodings) if position_axes_of(enc)[0] > 1), 0)
        self.tok = nn.Embedding(config.vocab_size, config.dim)
        self.blocks = nn.ModuleList(Block(config, enc, layer) for enc, layer in zip(encodings, layers))
        self.ln_f = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # residual projections, GPT-2 scaling
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * config.depth))
        bound = self.max_length
        if config.random_positions is not None and bound is not None and config.random_positions > bound:
            raise UsageError(
                f"random_positions ({config.random_positions}) must be <= max_positions ({bound}) of encoding "
                f"{config.encoding!r}: drawn positions go up to random_positions - 1"
            )

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def attentions(self) -> list[Attention]:
        """Every block's attention layer, in order."""
        return [block.attn for block in self.blocks if isinstance(block, Block)]

    @property
    def position_encoding(self) -> PositionalEncoding:
        """The encoding whose position axes ``positions`` may carry (see ``__init__``)."""
        return self.attentions()[self._position_layer].encoding

    @property
    def max_length(self) -> int | None:
        return getattr(self.encoding, "max_positions", None)

    def drop_positions(self) -> None:
        """Stop using positions from now on (DroPE, Gelberg et al. 2025): the input embedding and
        every attention get a parameter-free NoPE encoding, and ``config`` says ``nope``, so the model
        is a NoPE model with the same other weights (saved and loaded as one). The old encoding's
        parameters leave the model; an optimizer built before keeps them, without gradients."""
        nope = build("nope", num_heads=self.config.num_heads, head_dim=self.config.head_dim, causal=self.config.causal)
        self.encoding = nope
        for attn in self.attentions():
            attn.encoding = nope
        layers = self.config.layers
        schedule = None
        if layers is not None:  # windows, chunks, sinks and query scales stay: they are not encodings
            schedule = [{**layer, "encoding": "nope", "options": {}} for layer in layers.to_list()]
        self.config = replace(self.config, encoding="nope", encoding_options={}, max_positions=None, schedule=schedule)

    def new_cache(self, batch_size: int, capacity: int | None = None, padding=None) -> Cache:
        """A KV cache for ``batch_size`` rows (:class:`posenc.model.cache.Cache`).

        Args:
            capacity: tokens per row to reserve (e.g. prompt + new tokens); None grows by doubling.
            padding: left padding of each row (``batch_size`` integers >= 0): row b's first
                padding[b] tokens are padding, hidden from its real tokens. Prompts of different
                lengths decode together this way (see :meth:`generate`).

        Raises:
            UsageError: an encoder (``causal=False``), a batch size or capacity that is not a
                positive integer, padding that is not ``batch_size`` integers >= 0, or padding
                with a schedule that reads absolute positions.
        """
        if not self.config.causal:
            raise UsageError("incremental decoding needs a causal model (causal=True)")
        if capacity is not None:
            check_positive("capacity", capacity)
        schedule = self.config.layers
        if schedule is not None and check_padding(padding, batch_size) is not None and not schedule.shift_invariant:
            raise UsageError("padding: this schedule reads absolute positions (chunks, a query scale or an encoding that is not "
                             "shift-invariant), so left-padded rows cannot share one cache; decode rows of one prompt length together")
        windows = [attn.window for attn in self.attentions()]  # windowed layers keep O(W) keys
        return Cache(self, self.config.depth, check_positive("batch_size", batch_size), capacity, padding, windows)

    def generate(self, prompt, max_new_tokens: int, *, do_sample: bool = False, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None, eos_token_id=None,
                 pad_token_id: int | None = None, attention_mask: torch.Tensor | None = None,
                 num_return_sequences: int = 1) -> torch.Tensor:
        """Prompts and their continuations, (B * num_return_sequences, T + n) token ids, decoded one
        token at a time with a KV cache: greedy unless ``do_sample``, rows padded with
        ``pad_token_id`` after an ``eos_token_id`` (see :func:`posenc.model.generate.generate` for every
        argument and the batching rules)."""
        return generation.generate(self, prompt, max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k,
                        top_p=top_p, seed=seed, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                        attention_mask=attention_mask, num_return_sequences=num_return_sequences)

    def draw_positions(self, length: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """A sorted set of ``length`` distinct positions drawn uniformly from [0, random_positions):
        (length,) LongTensor, from torch's global generator (so ``torch.manual_seed`` repeats it)."""
        limit = self.config.random_positions
        if limit is None:
            raise UsageError("draw_positions needs LMConfig(random_positions=...) to be set")
        if length > limit:
            raise UsageError(f"random_positions ({limit}) must be >= the sequence length ({length}) to draw distinct positions")
        return torch.randperm(limit)[:length].sort().values.to(device)  # (T,)

    def forward(
        self,
        tokens: torch.Tensor,
        cache: Cache | None = None,
        positions: torch.Tensor | None = None,
        *,
        document_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab).

        Args:
            cache: a KV cache from :meth:`new_cache` (decoding; positions then continue it).
            positions: (T,) or (B, T) token positions (distinct and increasing within a document,
                >= 0; with a cache, (T,) continuing it); default 0..T-1 after the cache (per
                document, per row's first real token), or randomized positions in a training
                forward when ``random_positions`` is set. For a model whose encoding has
                ``position_axes`` > 1, also ids with an axis dimension ((3, B, T) for M-RoPE,
                (B, T, 2) for a patch grid), with or without a cache: the ids the rotation reads;
                the masks read the sequence index (with a cache, the slots). After such ids, a
                step without positions continues each row at its own next id, the same on every
                axis (``Cache.next_positions()``: M-RoPE's max(id) + 1 over the row).
            document_ids: (B, T) packed documents: no attention across documents, positions
                restarting at each (see :mod:`posenc.call.geometry`); no cache.
            attention_mask: (B, T) 1 on real tokens, 0 on padding (left or right, one contiguous
                run of real tokens per row); logits at padding are computed from nothing and
                should be ignored; no cache.

        Raises:
            UsageError: tokens outside the vocabulary, shapes that do not fit, a foreign cache.
        """
        if tokens.dim() != 2:
            raise UsageError(f"tokens must be (batch, length), got shape {tuple(tokens.shape)}")
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise UsageError(f"tokens must be integer token ids, got {str(tokens.dtype).removeprefix('torch.')}")
        # (not while compiling: the check reads the tokens, a graph break; the embedding's own bounds check stays)
        if tokens.numel() and not torch.compiler.is_compiling() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size):
            raise UsageError(
                f"tokens must be ids in [0, vocab_size={self.config.vocab_size}), got values in "
                f"[{int(tokens.min())}, {int(tokens.max())}]"
            )
        b, t = tokens.shape
        if cache is not None:
            self._check_cache(cache, b, t)
            if document_ids is not None or attention_mask is not None:
                raise UsageError("document_ids and attention_mask take no cache (a cache's padding comes from new_cache(padding=...))")
        geometry = self._geometry(tokens, cache, positions, document_ids, attention_mask)
        x = self.tok(tokens)  # (B, T, dim)
        if offers(self.encoding, Embeds):
            check_takes_axes(self.encoding, geometry.q_axes)
            # With a left-padded cache, each row's own positions (B, T): see Cache.embed_positions.
            embed = geometry.embed_positions
            x = self.encoding.embed(x, embed if cache is None else cache.embed_positions(embed))
        memo = ForwardMemo()  # T5's bias and the like: computed once for all layers
        if cache is None:
            for block in self.blocks:
                x = block(x, None, None, memo, geometry)
            return self.head(self.ln_f(x))  # (B, T, vocab)
        past = cache.length
        try:
            for i, block in enumerate(self.blocks):
                x = block(x, None, cache.layers[i], memo, geometry)
        except BaseException:  # no layer keeps a half-done step
            for layer in cache.layers:
                layer.length = min(layer.length, past)
            raise
        return self.head(self.ln_f(x))  # (B, T, vocab)

    def _geometry(self, tokens, cache, positions, document_ids, attention_mask) -> Geometry:
        """The forward's geometry, validated once for every layer."""
        b, t = tokens.shape
        device = tokens.device
        if cache is not None:  # the queries continue the cache; each layer's cache gives the key positions
            return Geometry.step(b, t, cache.length, device, positions=positions, encoding=self.position_encoding,
                                 next_positions=cache.next_positions())
        mask = None if attention_mask is None else key_padding_mask_of(attention_mask)
        if positions is None and self.training and self.config.random_positions is not None:
            positions = self._random_positions(b, t, device, document_ids, mask)
        return Geometry.of(b, t, t, device, positions=positions, causal=self.config.causal, document_ids=document_ids,
                           key_padding_mask=mask, encoding=self.position_encoding)

    def _random_positions(self, b, t, device, document_ids, mask) -> torch.Tensor:
        """Randomized positions: one sorted draw, indexed by each token's in-document position."""
        if document_ids is None and mask is None:
            return self.draw_positions(t, device)  # (T,) shared by the batch, queries and keys
        plain = Geometry.of(b, t, t, device, causal=self.config.causal, document_ids=document_ids, key_padding_mask=mask)
        index = plain.q_positions  # (B, T): in-document positions
        table = self.draw_positions(int(index.max()) + 1, device)  # (L,) sorted
        return table[index]  # (B, T): increasing within each document

    def _check_cache(self, cache: Cache, b: int, t: int) -> None:
        if not isinstance(cache, Cache):
            raise UsageError(f"cache must come from this model's new_cache(), got {type(cache).__name__}")
        if not cache.owned_by(self):
            raise UsageError("cache was made by another model (make one with this model's new_cache())")
        if cache.batch_size != b:
            raise UsageError(f"cache was made for batch_size={cache.batch_size}, tokens have batch {b}")
        if t == 0:
            raise UsageError("tokens must hold at least one token per row when a cache is given, got length 0")
