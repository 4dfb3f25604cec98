"""PyTorch's fused ``scaled_dot_product_attention``.

Without a score bias the causal case uses ``is_causal=True``, which lets the kernel skip the upper
triangle. A bias is passed as a dense (H, Tq, Tk) ``attn_mask``: correct, but the kernel then does
the full square and the (H, Tq, Tk) bias is written out, so the blocked backend is preferred on CPU
(this path is the fallback where torch lacks the CPU flash ops blocked needs).

A decode step (one query) takes the single-query path (``backends/parts/single.py``): the bias is then
one vector per head, the kernel's mask. Left-padded rows (generation in batches) are split into
unpadded calls (``backends/parts/padding.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .parts import padding, regions, single
from .parts.base import ScoreSpec, additive_mask


def supports(spec: ScoreSpec, q: torch.Tensor) -> bool:
    return not (spec.has_query_terms or spec.has_value_terms) and padding.supported(spec)


def preferred(spec: ScoreSpec, q: torch.Tensor) -> bool:
    # Bias methods too where the blocked backend cannot help: positions that skip values
    # (randomized positions, a training-length call), or a CPU torch without the flash ops.
    fallback = not spec.consecutive or (q.device.type == "cpu" and not regions.FLASH_OPS)
    return spec.plain or (spec.has_bias and supports(spec, q) and fallback)


def takes_grouped_heads(spec: ScoreSpec) -> bool:
    """Without score terms the fused kernel broadcasts grouped key/value heads itself (enable_gqa)."""
    return spec.plain


@single.steps_and_padding  # a decode step and left-padded rows first (backends/parts/single.py)
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec) -> torch.Tensor:
    tq, tk = q.shape[-2], k.shape[-2]
    if not spec.has_bias:
        gqa = k.shape[1] != q.shape[1]  # grouped key/value heads: the kernel broadcasts them itself
        if not spec.causal or tq == 1 and spec.aligned:
            return F.scaled_dot_product_attention(q, k, v, scale=spec.scale, enable_gqa=gqa)
        if tq == tk:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=spec.scale, enable_gqa=gqa)
        # Cached decoding of several tokens: is_causal would align the mask top-left.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=spec.allowed(), scale=spec.scale, enable_gqa=gqa)
    mask = spec.bias().to(q.dtype)  # (H, Tq, Tk)
    causal = additive_mask(spec.allowed(), q.dtype)
    if causal is not None:
        mask = mask + causal
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=spec.scale)
