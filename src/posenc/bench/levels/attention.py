"""Attention level: the core of one :class:`posenc.Attention` call, q, k, v given.

What is timed is everything the attention does with the encoding (its ``rotate``, ``bias`` /
``score``, ``query_terms`` / ``value_terms`` hooks) plus the backend: ``posenc.Attention`` itself
with its two projections replaced by identities, so the benchmark follows whatever the attention
does. ``embed`` (sinusoidal, learned) is applied once per model forward, not per attention call, so
at this level those methods do exactly NoPE's work (their ratios show the run's noise); the model
level shows their cost. A method written as a one-layer schedule (``[rope window=256]``) is that
layer: its encoding and its attention kind (window, chunk, sinks, query scale). train = forward + backward (random upstream gradient); infer = forward
under ``torch.inference_mode``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...encodings import build as build_encoding
from ...encodings.protocol import Curves, Gates, offers
from ...model.attention import Attention
from ..job import Job
from .base import Level, Workload, schedule_of


def build(job: Job, device: torch.device, dtype: torch.dtype) -> Workload:
    dim, heads, b, n = job.dim, job.heads, job.batch, job.length
    schedule = schedule_of(job.method, 1)  # a one-layer schedule: that layer's encoding and attention kind
    if schedule is None:
        encoding = build_encoding(job.method, num_heads=heads, head_dim=dim // heads, causal=True)
        kind: dict[str, Any] = {}
    else:
        layer = schedule.layers[0]
        encoding = build_encoding(layer.encoding, num_heads=heads, head_dim=dim // heads, causal=True, **layer.options)
        kind = dict(window=layer.window, chunk=layer.chunk, sinks=layer.sinks, query_scale=layer.query_scale)
    attn = Attention(dim, heads, encoding, causal=True, backend=job.backend, **kind)
    # Identity projections: the input already holds q, k, v side by side, so the timed work is the
    # encoding's hooks plus the backend, exactly as Attention.forward runs them.
    attn.qkv, attn.proj = nn.Identity(), nn.Identity()
    if offers(encoding, Gates):  # FoX's gates read the layer input (dim wide): here its q part
        gates = encoding.log_gates
        setattr(encoding, "log_gates", lambda x: gates(x[..., :dim]))  # an instance attribute over the method
    if offers(encoding, Curves):  # the Inkling curves read the layer input (dim wide) too: its q part
        curves = encoding.query_curves
        setattr(encoding, "query_curves", lambda x, positions: curves(x[..., :dim], positions))
    attn = attn.to(device=device, dtype=dtype)
    train = job.mode == "train"
    attn.train(train)
    qkv = torch.randn(b, n, 3 * dim, device=device, dtype=dtype, requires_grad=train)  # (B, T, 3 x H x D)
    grad = torch.randn(b, n, dim, device=device, dtype=dtype)  # (B, T, H x D) upstream gradient
    params = [p for p in attn.parameters() if p.requires_grad]

    def step() -> None:
        if train:
            attn(qkv).backward(grad)
            qkv.grad = None
            for p in params:
                p.grad = None
        else:
            with torch.inference_mode():
                attn(qkv)

    return Workload(step, attn)


def describe(sizes: dict) -> str:
    return f"attention core, B={sizes['batch']}, H={sizes['heads']}, D={sizes['dim'] // sizes['heads']}, causal"


LEVEL = Level(
    name="attention",
    summary="one attention core (q, k, v given: encoding hooks + backend), B=1 H=8 D=64",
    modes=("train", "infer"),
    sizes={"dim": 512, "heads": 8, "batch": 1, "depth": 1, "vocab": 256},
    build=build,
    describe=describe,
)
