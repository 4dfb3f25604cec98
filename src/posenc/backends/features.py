"""Exactly low-rank biases as extra q/k features: one SDPA call with its causal skip.

An encoding that offers :class:`~posenc.encodings.protocol.BiasFeatures` (Sandwich) gives its bias as
``qf_i . kf_j`` up to a per-query constant, which a softmax does not see. Appending the features to
q and k makes the fused kernel add it by itself::

    q' = [q, qf / scale],  k' = [k, kf]   =>   q' . k' * scale = q . k * scale + qf . kf

so attention with the bias is plain SDPA: ``is_causal=True`` for a full pass (the kernel skips the
upper triangle, no mask is built), a boolean (Tq, Tk) mask otherwise (cached decoding), nothing for
an encoder. No (H, N, N) tensor exists, forward or backward. q, k and v are padded with zeros to a
multiple of ``MULTIPLE`` features: the CPU kernel needs one head dim for q, k and v, and runs
multiples of 8 nearly as fast as 64 (an odd width falls off its fast path); the output's extra
features are dropped. Gradients reach q, k, v (and the features, should an encoding learn them)
through autograd, since every step is a plain differentiable op.

Cost: SDPA's time grows with the head dim, so every feature costs (q, k and v all grow); an
encoding should keep its feature count small (Sandwich's ``sinusoid_dim``). The features are exact
for any positions, consecutive or not.

Precision: qf / scale is about sqrt(D) times qf; in float32 the products are summed with q . k's,
so the bias is as exact as float32 scores are (tests hold it to the eager formula at 1e-5). In
bfloat16/float16 the features are rounded to 8 (or 11) bits like q and k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..encodings.protocol import BiasFeatures, offers, require
from .parts import padding, single
from .parts.base import ScoreSpec

MULTIPLE = 8  # q, k and v are padded to a multiple of this many features


def supports(spec: ScoreSpec, q: torch.Tensor) -> bool:
    # A padded call goes through the row split of ``steps_and_padding`` below.
    return offers(spec.encoding, BiasFeatures) and not (spec.has_query_terms or spec.has_value_terms) and padding.supported(spec)


def preferred(spec: ScoreSpec, q: torch.Tensor) -> bool:
    return supports(spec, q)


def widen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k with the bias features appended and q, k, v zero-padded to one width, a multiple of
    :data:`MULTIPLE`: (B, H, T, D') each."""
    qf, kf = require(spec.encoding, BiasFeatures).bias_features(spec.q_positions, spec.k_positions)  # (H, Tq, F), (H, Tk, F)
    b, d, f = q.shape[0], q.shape[-1], qf.shape[-1]
    width = max(d + f, v.shape[-1])
    width += -width % MULTIPLE
    qf = (qf.to(q.dtype) / spec.scale).expand(b, -1, -1, -1)  # (B, H, Tq, F)
    kf = kf.to(k.dtype).expand(b, -1, -1, -1)  # (B, H, Tk, F)
    q2 = F.pad(torch.cat((q, qf), -1), (0, width - d - f))  # (B, H, Tq, D')
    k2 = F.pad(torch.cat((k, kf), -1), (0, width - d - f))  # (B, H, Tk, D')
    v2 = F.pad(v, (0, width - v.shape[-1]))  # (B, H, Tk, D')
    return q2, k2, v2


@single.steps_and_padding  # a decode step and left-padded rows first (backends/parts/single.py)
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec) -> torch.Tensor:
    q2, k2, v2 = widen(q, k, v, spec)
    tq, tk = q.shape[-2], k.shape[-2]
    if not spec.causal or (tq == 1 and spec.aligned):  # an encoder, or one decoded token: every key
        out = F.scaled_dot_product_attention(q2, k2, v2, scale=spec.scale)
    elif tq == tk and spec.aligned:
        out = F.scaled_dot_product_attention(q2, k2, v2, is_causal=True, scale=spec.scale)  # the causal skip
    else:  # cached decoding of several tokens, or any other geometry: the mask from the positions
        out = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=spec.allowed(), scale=spec.scale)
    return out[..., : v.shape[-1]]  # (B, H, Tq, Dv)
