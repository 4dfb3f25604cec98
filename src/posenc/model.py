"""A small Transformer language model around the attention: decoder (causal) or encoder.

nanoGPT-shaped: pre-LayerNorm blocks, GELU MLP, token embedding tied to the output head. Positions
come only from the encoding: ``embed`` once on the input, the other hooks inside each attention.
Encodings with ``shares_across_layers`` are built once and used by every layer (T5's bias table,
and the parameter-free methods); the others get one instance per layer.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from . import backends
from .attention import Attention, LayerCache
from .memo import ForwardMemo
from .encodings import build, get_class, options_of
from .errors import UsageError
from .encodings.base import check_positive
from .encodings.protocol import Embeds, offers


@dataclass
class LMConfig:
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

    def __post_init__(self) -> None:
        get_class(self.encoding)  # unknown name -> ValueError listing the choices
        for name in ("vocab_size", "dim", "depth", "num_heads", "mlp_ratio"):
            check_positive(name, getattr(self, name))
        if self.dim % self.num_heads:
            raise UsageError(f"dim ({self.dim}) must be divisible by num_heads ({self.num_heads})")
        if self.max_positions is not None:
            check_positive("max_positions", self.max_positions)
        backends.check_name(self.attention_backend)

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    def to_dict(self) -> dict:
        return asdict(self)


class Cache:
    """KV cache for incremental decoding: one :class:`LayerCache` per layer plus the length."""

    def __init__(self, depth: int, batch_size: int) -> None:
        self.layers = [LayerCache() for _ in range(depth)]
        self.batch_size = batch_size
        self.length = 0


class MLP(nn.Module):
    def __init__(self, dim: int, ratio: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, ratio * dim)
        self.proj = nn.Linear(ratio * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, config: LMConfig, encoding: nn.Module) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.dim)
        self.attn = Attention(config.dim, config.num_heads, encoding, config.causal, config.attention_backend)
        self.ln2 = nn.LayerNorm(config.dim)
        self.mlp = MLP(config.dim, config.mlp_ratio)

    def forward(self, x, positions, cache=None, memo=None):
        x = x + self.attn(self.ln1(x), positions, cache, memo)
        return x + self.mlp(self.ln2(x))


class LM(nn.Module):
    """tokens (B, T) -> logits (B, T, vocab). ``cache`` (from :meth:`new_cache`) decodes incrementally."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.config = config
        options = dict(config.encoding_options)
        cls = get_class(config.encoding)
        if config.max_positions is not None and "max_positions" in options_of(cls):
            options.setdefault("max_positions", config.max_positions)

        def make():
            return build(config.encoding, num_heads=config.num_heads, head_dim=config.head_dim, causal=config.causal, **options)

        first = make()
        encodings = [first] + [first if cls.shares_across_layers else make() for _ in range(config.depth - 1)]
        self.encoding = first  # the one whose embed() is applied to the input
        self.tok = nn.Embedding(config.vocab_size, config.dim)
        self.blocks = nn.ModuleList(Block(config, enc) for enc in encodings)
        self.ln_f = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # residual projections, GPT-2 scaling
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * config.depth))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

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
        for block in self.blocks:
            block.attn.encoding = nope
        self.config = replace(self.config, encoding="nope", encoding_options={}, max_positions=None)

    def new_cache(self, batch_size: int) -> Cache:
        if not self.config.causal:
            raise UsageError("incremental decoding needs a causal model (causal=True)")
        return Cache(self.config.depth, check_positive("batch_size", batch_size))

    def forward(self, tokens: torch.Tensor, cache: Cache | None = None) -> torch.Tensor:
        if tokens.dim() != 2:
            raise UsageError(f"tokens must be (batch, length), got shape {tuple(tokens.shape)}")
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise UsageError(f"tokens must be integer token ids, got {str(tokens.dtype).removeprefix('torch.')}")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size):
            raise UsageError(
                f"tokens must be ids in [0, vocab_size={self.config.vocab_size}), got values in "
                f"[{int(tokens.min())}, {int(tokens.max())}]"
            )
        b, t = tokens.shape
        if cache is not None and cache.batch_size != b:
            raise UsageError(f"cache was made for batch_size={cache.batch_size}, tokens have batch {b}")
        past = 0 if cache is None else cache.length
        positions = torch.arange(past, past + t, device=tokens.device)  # (T,)
        x = self.tok(tokens)  # (B, T, dim)
        if offers(self.encoding, Embeds):
            x = self.encoding.embed(x, positions)
        memo = ForwardMemo()  # T5's bias and the like: computed once for all layers
        for i, block in enumerate(self.blocks):
            x = block(x, positions, None if cache is None else cache.layers[i], memo)
        if cache is not None:
            cache.length += t
        return self.head(self.ln_f(x))  # (B, T, vocab)
