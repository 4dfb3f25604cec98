"""Decode level: one generated token per row after a KV cache of N tokens (N = ``lengths``).

What is timed is one decode step of the study's LM (:class:`posenc.LM`): the new tokens (B, 1)
through every layer with the cache, the logits, and a greedy choice; then the cache is cropped back
to N (O(1) in posenc), so every timed step decodes at the same length. Modes: ``single`` is one
sequence (batch 1), ``batched`` is ``batch`` sequences (default 8): a step yields one token per
row, so the time column is seconds per token for ``single`` and per step of B tokens for
``batched``, and tokens/s counts every row's token.

The cache is filled with random keys and values (B x N per layer), not by a prefill: what a step
costs does not depend on the values it reads, and a prefill of 8 x 8,192 tokens would take far
longer than the measurement. With ``compare=["transformers"]``, Hugging Face's LLaMA (RoPE) and
BLOOM (ALiBi) of the same sizes decode the same way with their own cache
(:mod:`posenc.bench.libraries.hftransformers`); other methods have no counterpart there.
"""

from __future__ import annotations

import torch

from ...model.lm import LM, LMConfig
from ..job import POSENC, Job
from ..libraries import library_of
from .base import Level, Refused, Workload, schedule_of


def batch_of(job: Job) -> int:
    return 1 if job.mode == "single" else job.batch


def build_posenc(job: Job, batch: int, device: torch.device, dtype: torch.dtype) -> Workload:
    schedule = schedule_of(job.method, job.depth)  # a method written as a layer schedule
    positions = {"encoding": job.method} if schedule is None else {"schedule": schedule.to_list()}
    config = LMConfig(
        **positions, vocab_size=job.vocab, dim=job.dim, depth=job.depth, num_heads=job.heads,
        max_positions=job.length + 1, attention_backend=job.backend,
    )
    model = LM(config).to(device=device, dtype=dtype).eval()
    n, heads, head_dim = job.length, job.heads, job.dim // job.heads
    token = torch.randint(0, job.vocab, (batch, 1), device=device)  # (B, 1)
    probe = model.new_cache(batch, capacity=1)
    with torch.inference_mode():
        model(token, cache=probe)  # the width of the keys the cache holds (PoPE's are 2D wide)
    assert probe.layers[0].k is not None
    key_dim = probe.layers[0].k.shape[-1]
    cache = model.new_cache(batch, capacity=n + 1)
    with torch.inference_mode():
        for layer in cache.layers:  # random keys and values: what a step costs does not depend on them
            k = torch.randn(batch, heads, n, key_dim, device=device, dtype=dtype)  # (B, H, N, key_dim)
            layer.append(k, torch.randn(batch, heads, n, head_dim, device=device, dtype=dtype))

    def step() -> None:
        with torch.inference_mode():
            model(token, cache=cache)[:, -1].argmax(-1)
        cache.crop(n)

    return Workload(step, model)


def build(job: Job, device: torch.device, dtype: torch.dtype) -> Workload:
    batch = batch_of(job)
    if job.impl == POSENC:
        return build_posenc(job, batch, device, dtype)
    library = library_of(job.impl)
    try:
        model = library.build_model(job).to(device=device, dtype=dtype).eval()
    except Exception as err:  # the library's own refusal of this configuration
        raise Refused(f"{type(err).__name__}: {err}") from err
    return Workload(library.decode_step(model, batch, job.length, device, dtype), None)


def tokens(job: Job) -> int:
    """Tokens a step generates: one per row."""
    return batch_of(job)


def describe(sizes: dict) -> str:
    return (
        f"one decoded token after a KV cache of N, LM dim {sizes['dim']}, depth {sizes['depth']}, {sizes['heads']} heads, "
        f"vocab {sizes['vocab']}; single: batch 1, batched: batch {sizes['batch']}"
    )


LEVEL = Level(
    name="decode",
    summary="one generated token after a KV cache of N (the study's LM, batch 1 and 8)",
    modes=("single", "batched"),
    sizes={"dim": 256, "heads": 8, "batch": 8, "depth": 4, "vocab": 256},
    build=build,
    describe=describe,
    units={"single": "s/token", "batched": "s/step"},
    compare=("transformers",),
    tokens=tokens,
)
