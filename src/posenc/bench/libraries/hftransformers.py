"""Hugging Face transformers as a compared library: LLaMA for RoPE, BLOOM for ALiBi.

The counterparts of ``posenc.LM`` are built from configs with random weights (nothing downloaded):
the same width, depth, heads, head dim and vocabulary, tied embeddings; LLaMA's MLP is SwiGLU with
``intermediate_size = 4 x dim`` (three matrices where posenc's GELU MLP has two), BLOOM's is GELU
with 4 x dim as posenc's. Attention as each model runs it by default: LLaMA through SDPA
(``attn_implementation="sdpa"``), BLOOM eagerly (its ALiBi is added to the scores with
``baddbmm``). Their KV cache is transformers' ``DynamicCache``, which concatenates at every step.
Other methods have no counterpart here ("n/a"). Read from transformers 5.24's source: the cache
argument of ``forward`` is ``cache`` (``past_key_values`` before 5.x).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ..job import Job

if TYPE_CHECKING:
    from transformers import DynamicCache

NAME = "transformers"
PACKAGE = "transformers"  # import name, checked before any job runs
HF = "transformers"
IMPLS = (HF,)
METHODS = {"rope": "llama", "alibi": "bloom"}  # posenc method -> architecture


def has_counterpart(method: str) -> bool:
    return method in METHODS


def build_model(job: Job) -> nn.Module:
    """The transformers decoder LM matching posenc's LM for ``job`` (random weights)."""
    arch = METHODS.get(job.method)
    if arch is None:
        raise ValueError(f"transformers has no counterpart of {job.method!r} here")
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=job.vocab, hidden_size=job.dim, intermediate_size=4 * job.dim, num_hidden_layers=job.depth,
            num_attention_heads=job.heads, num_key_value_heads=job.heads, head_dim=job.dim // job.heads,
            max_position_embeddings=max(job.length + 64, 2048), tie_word_embeddings=True,
            attn_implementation="sdpa",  # type: ignore[call-arg]  # taken by the config's **kwargs, which its dataclass signature omits
        )
        return LlamaForCausalLM(config)
    from transformers import BloomConfig, BloomForCausalLM

    bloom = BloomConfig(
        vocab_size=job.vocab, hidden_size=job.dim, n_layer=job.depth, n_head=job.heads, tie_word_embeddings=True,
        attn_implementation="eager",  # type: ignore[call-arg]  # taken by the config's **kwargs, which its dataclass signature omits
    )
    return BloomForCausalLM(bloom)


class _Step:
    """One timed decode step (see :func:`decode_step`); ``cache`` stays at its length (for tests)."""

    def __init__(self, model: nn.Module, token: torch.Tensor, cache: DynamicCache) -> None:
        self.model, self.token, self.cache = model, token, cache

    def __call__(self) -> None:
        with torch.inference_mode():
            logits = self.model(input_ids=self.token, cache=self.cache, use_cache=True).logits  # (B, 1, vocab)
            logits[:, -1].argmax(-1)
        self.cache.crop(-1)


def decode_step(model: nn.Module, batch: int, length: int, device: torch.device, dtype: torch.dtype) -> Callable[[], None]:
    """One greedy token for ``batch`` rows after a cache of ``length`` random keys and values, then
    the cache cropped back to ``length`` (so every timed step decodes at the same length)."""
    from transformers import DynamicCache

    config: Any = model.config  # a transformers config, read by attribute (its fields are per model class)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = config.hidden_size // config.num_attention_heads
    cache = DynamicCache(config=config)
    for layer in range(config.num_hidden_layers):
        k = torch.randn(batch, heads, length, head_dim, device=device, dtype=dtype)  # (B, H, N, D)
        cache.update(k, torch.randn_like(k), layer)
    token = torch.randint(0, config.vocab_size, (batch, 1), device=device)  # (B, 1)
    return _Step(model, token, cache)
