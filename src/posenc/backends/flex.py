"""FlexAttention: ``torch.nn.attention.flex_attention`` with the encoding's scalar form as score_mod.

The encoding's ``score(h, i, j)`` (the :class:`~posenc.encodings.protocol.Scores` capability) is exactly what a fused kernel's score modifier
needs, so ALiBi and T5 run in one compiled kernel, with the causal mask as a block mask that skips
whole tiles: no (H, N, N) tensor, and the T5 table gets its gradient through the captured weight.

Where it runs: CUDA (training and inference), and CPU for inference only (FlexAttention has no CPU
backward: NotImplementedError in torch 2.13), both needing ``torch.compile`` (a C++ compiler on
CPU, Triton on CUDA). The first call compiles the kernel (a C++ build on CPU, far longer than
the calls it serves), so "auto" picks it on CUDA only; on CPU ``blocked`` is the faster one
anyway (``benchmarks/attention_table.sh`` runs both). ``supports`` never picks it where it cannot run.

A decode step (one query) does not go through the compiled kernel (a new key length per step):
the bias is one vector per head, SDPA's mask (``backends/parts/single.py``). Left-padded rows are split
into unpadded calls (``backends/parts/padding.py``).
"""

from __future__ import annotations

import functools
import os
import shutil
import sysconfig
import weakref
from typing import Callable, cast

import torch

from ..encodings.protocol import Scores, require
from .parts import padding, single
from .parts.base import ScoreSpec, needs_grad

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

    FLEX = True
except ImportError:  # older torch
    FLEX = False

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CPU_KEY_MULTIPLE = 16  # keys are padded to this on CPU (see attend)


@functools.cache
def compile_available(device_type: str) -> bool:
    """Whether torch.compile can build a flex kernel on this device type (cheap checks, no build)."""
    if not FLEX:
        return False
    if device_type == "cuda":
        try:
            from torch.utils._triton import has_triton
        except ImportError:
            return False
        return torch.cuda.is_available() and has_triton()
    if device_type == "cpu":
        from torch._inductor import config

        compilers = [c for c in config.cpp.cxx if c] or ["g++"]
        headers = os.path.join(sysconfig.get_paths()["include"], "Python.h")
        return any(shutil.which(c) for c in compilers) and os.path.exists(headers)
    return False


def supports(spec: ScoreSpec, q: torch.Tensor) -> bool:
    if not spec.consecutive:  # the score_mod reads positions as offset + index
        return False
    if not padding.supported(spec):
        return False
    if spec.has_query_terms or spec.has_value_terms or (spec.has_bias and not spec.has_score_mod):
        return False
    if q.dtype not in DTYPES or not compile_available(q.device.type):
        return False
    if q.device.type == "cpu" and needs_grad(spec, q):
        return False  # no CPU backward
    return q.device.type in ("cpu", "cuda")


def preferred(spec: ScoreSpec, q: torch.Tensor) -> bool:
    return q.device.type == "cuda" and spec.has_bias and supports(spec, q)


@functools.cache
def _compiled() -> Callable[..., torch.Tensor]:
    # Shapes become dynamic after the first recompile, so decoding does not compile at every step.
    compiled: Callable[..., torch.Tensor] = torch.compile(flex_attention)
    return compiled


class _Offsets:
    """Absolute position of query 0 and key 0, as tensors the compiled kernel reads (no recompiles).

    Each call gets new tensors rather than writing into these: a backward may still need them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.set(0, 0)

    def set(self, q_start: int, k_start: int) -> None:
        self.q = torch.tensor(q_start, device=self.device)
        self.k = torch.tensor(k_start, device=self.device)


# One score_mod per encoding and device, reused across calls so the kernel compiles once. Keyed
# weakly by the encoding, and the score_mod reaches the encoding through a weak reference too, so
# an entry goes away with its encoding (nothing here keeps a model alive).
ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (score, b, h, q_idx, kv_idx) -> score
_score_mods: "weakref.WeakKeyDictionary[torch.nn.Module, dict[torch.device, tuple[_Offsets, ScoreMod]]]" = weakref.WeakKeyDictionary()
_block_masks: dict[tuple[object, ...], BlockMask] = {}


def _score_mod(encoding: torch.nn.Module, device: torch.device) -> tuple[_Offsets, ScoreMod]:
    per_device = _score_mods.setdefault(encoding, {})
    hit = per_device.get(device)
    if hit is None:
        offsets = _Offsets(device)
        ref = weakref.ref(require(encoding, Scores))

        def score_mod(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            enc = cast(Scores, ref())  # alive while its entry is: the entry goes away with it
            return score + enc.score(h, q_idx + offsets.q, kv_idx + offsets.k).to(score.dtype)

        hit = per_device[device] = (offsets, score_mod)
    return hit


def _block_mask(tq: int, tk: int, padded: int, shift: int | None, device: torch.device) -> BlockMask | None:
    """Keys < tk (the rest is padding), and key position <= query position when ``shift``
    (= q_start - k_start) is given; None when every pair is allowed."""
    if shift is None and padded == tk:
        return None
    key = (tq, tk, padded, shift, device)
    mask = _block_masks.get(key)
    if mask is None:
        if len(_block_masks) > 32:
            _block_masks.clear()

        def allowed(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            inside = kv_idx < tk
            return inside if shift is None else inside & (q_idx + shift >= kv_idx)

        mask = _block_masks[key] = create_block_mask(allowed, None, None, tq, padded, device=device)
    return mask


@single.steps_and_padding  # a decode step and left-padded rows first (backends/parts/single.py)
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec) -> torch.Tensor:
    tq, tk = q.shape[-2], k.shape[-2]
    qs, ks = spec.q_start, spec.k_start
    score_mod = None
    if spec.has_bias:
        offsets, score_mod = _score_mod(spec.encoding, q.device)
        offsets.set(qs, ks)
    padded = tk
    if q.device.type == "cpu" and tk % CPU_KEY_MULTIPLE:
        # torch 2.13's compiled CPU kernel returns wrong values for some key lengths (e.g. 8, 24,
        # 40, 56 with short query blocks); keys padded to a multiple of 16 and masked are right.
        padded = tk + (-tk % CPU_KEY_MULTIPLE)
        k = torch.nn.functional.pad(k, (0, 0, 0, padded - tk))
        v = torch.nn.functional.pad(v, (0, 0, 0, padded - tk))
    block_mask = _block_mask(tq, tk, padded, qs - ks if spec.causal else None, q.device)
    return _compiled()(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=spec.scale)
