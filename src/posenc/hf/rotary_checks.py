"""posenc's RoPE read from a model's config, checked against the model's own rotary module before
:func:`posenc.hf.use` accepts it: the inverse frequencies and attention factor it holds
(:func:`rotary_buffer`; a ``[sin | cos]`` table's for GPT-J and CodeGen, every position of it), the
axes of an M-RoPE or XD-RoPE module (:func:`posenc.hf.mrope.check_axes`), and for a model outside the
family table the pair layout of its ``apply_rotary_pos_emb`` (:func:`check_rotation`). A difference
is a UsageError naming it, never a silently different model.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from ..encodings.base import PositionalEncoding
from ..encodings.mrope import MRoPE
from ..encodings.rope import RoPE, apply_rotation
from ..encodings.xdrope import XDRoPE
from ..errors import UsageError
from .families import Family
from .mrope import check_axes


def rotary_tables(rotary: nn.Module, kind: str | None, family: Family | None = None) -> tuple[torch.Tensor, float]:
    """The model's own inverse frequencies (r/2,) and attention factor for layers of ``kind``
    (float32 on the CPU; :func:`rotary_buffer` for the buffer as the model holds it)."""
    inv, factor = rotary_buffer(rotary, kind, family)
    return (inv if inv.is_meta else inv.float().cpu()), factor


def _sincos_table(rotary: nn.Module, family: Family) -> torch.Tensor:
    """The family's (positions, r) ``[sin | cos]`` table held by its rotary module (``Family.sincos_table``).

    Raises:
        UsageError: the module holds no such 2-D table of an even width, or it has fewer than 2 rows.
    """
    name = str(family.sincos_table)
    table = getattr(rotary, name, None)
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[-1] % 2 or table.shape[0] < 2:
        shape = tuple(table.shape) if isinstance(table, torch.Tensor) else type(table).__name__
        raise UsageError(f"model: the {family.name} family rotates with a (positions, r) [sin | cos] table {name!r} of its "
                         f"rotary module, and {type(rotary).__name__} holds {shape}; posenc cannot check its RoPE")
    return table.detach()


def _table_frequencies(table: torch.Tensor) -> torch.Tensor:
    """The inverse frequencies (r/2,) of a (positions, r) ``[sin | cos]`` table: the angles of its
    position 1 (each below pi: atan2 of its sin and cos), in the table's dtype and device."""
    if table.is_meta:
        return torch.empty(table.shape[-1] // 2, device="meta")
    sin, cos = table[1].double().chunk(2)  # (r/2,) each
    return torch.atan2(sin, cos).to(table.dtype)


def _check_table(encoding: RoPE, table: torch.Tensor, name: str, where: str) -> None:
    """posenc's RoPE against a whole ``[sin | cos]`` table (row p: sin and cos of p times each frequency):
    within the table's rounding, which grows with the angle (float32 angles of p * theta), else a UsageError
    naming the first position that differs."""
    held = table.dtype if table.is_floating_point() else torch.float32
    rows = table.shape[0]
    positions = torch.arange(rows, dtype=torch.float64)
    angles = positions[:, None] * encoding.inv_freq.detach().double().cpu()[None]  # (P, r/2)
    ours = torch.cat((angles.sin(), angles.cos()), dim=-1)  # (P, r)
    # the value's rounding in its dtype, and the angle's in float32 (p * theta, theta <= 1) with the frequency's
    tol = 2 * torch.finfo(held).eps + 8 * torch.finfo(torch.float32).eps * (positions + 1)  # (P,)
    gap = (table.double().cpu() - ours).abs().amax(-1)  # (P,)
    bad = (gap > tol).nonzero()
    if bad.numel():
        p = int(bad[0, 0])
        raise UsageError(f"rope: posenc's RoPE read from the {name} config (base {encoding.base:g}, {encoding.rotary_dim} "
                         f"rotated features, {encoding.layout} pairs) differs from the model's table {where} at position {p} "
                         f"(by {float(gap[p]):.2e}); refusing a wrong model")


def rotary_buffer(rotary: nn.Module, kind: str | None, family: Family | None = None) -> tuple[torch.Tensor, float]:
    """The rotary module's inverse-frequency buffer for layers of ``kind`` (detached, in the model's
    dtype and device) and its attention factor; of a family with a ``[sin | cos]`` table
    (``Family.sincos_table``: GPT-J), the frequencies of the table's position 1 and a factor of 1.

    Raises:
        UsageError: the rotary module has no such buffer.
    """
    if family is not None and family.sincos_table is not None:
        return _table_frequencies(_sincos_table(rotary, family)), 1.0
    inv = getattr(rotary, f"{kind}_inv_freq", None) if kind else None
    factor = getattr(rotary, f"{kind}_attention_scaling", None) if kind else None
    if inv is None:
        inv = getattr(rotary, "inv_freq", None)
        factor = getattr(rotary, "attention_scaling", 1.0)
    if not isinstance(inv, torch.Tensor):
        looked = f"`{kind}_inv_freq` or `inv_freq`" if kind else "`inv_freq`"
        typed = sorted(n for n, _ in rotary.named_buffers(recurse=False) if n.endswith("inv_freq"))
        raise UsageError(f"model: posenc read the rotated features from its rotary module {type(rotary).__name__}'s "
                         f"buffer {looked}, and it has none ({'its buffers: ' + ', '.join(typed) if typed else 'no inv_freq buffer'}"
                         "), so posenc cannot check its RoPE against the config")
    return inv.detach(), float(1.0 if factor is None else factor)


def check_rotation(model: Any, rotary: nn.Module, r: int, layout: str) -> None:
    """For a model outside the family table: its ``apply_rotary_pos_emb`` must rotate as posenc's
    RoPE in ``layout`` over r features, or the model is refused."""
    module = sys.modules.get(type(rotary).__module__)
    apply = getattr(module, "apply_rotary_pos_emb", None)
    if apply is None:
        raise UsageError(f"model: model_type {model.config.model_type!r} is not in posenc's family table and its modeling "
                         "module has no apply_rotary_pos_emb(q, k, cos, sin) to check its rotation against")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 6, r, generator=gen)
    positions = torch.arange(6)
    inv, _ = rotary_tables(rotary, None)
    angles = positions[:, None].float() * inv[None]  # (T, r/2)
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1)[None], torch.cat((angles.sin(), angles.sin()), -1)[None]
    try:
        theirs = apply(x, x, cos, sin)[0]
    except Exception as error:  # their function's own signature or shapes
        raise UsageError(f"model: model_type {model.config.model_type!r} is not in posenc's family table and its "
                         f"apply_rotary_pos_emb does not take (q, k, cos, sin) as LLaMA's does ({error})") from error
    if not torch.allclose(theirs, _rotate_with(layout, x, inv, positions), atol=1e-5):
        raise UsageError(f"model: model_type {model.config.model_type!r} is not in posenc's family table and its rotation "
                         f"is not LLaMA's ({layout} pairs over the first {r} features); add a family row "
                         "(posenc.hf.families.FAMILIES) to describe it")


def _rotate_with(layout: str, x: torch.Tensor, inv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x (1, 1, T, r) rotated at ``positions`` by frequencies ``inv`` (r/2,) in ``layout``."""
    angles = positions[:, None].float() * inv[None]
    return apply_rotation(x, angles.cos(), angles.sin(), layout)


def verify_rope(encoding: PositionalEncoding, rotary: nn.Module, kind: str | None, family: Family | None,
                 model_type: Any = None) -> None:
    """posenc's RoPE (or M-RoPE) read from the config against the model's own tables: the same frequencies and
    attention factor (M-RoPE: and the same rotation on 3-axis ids, :func:`posenc.hf.mrope.check_axes`), or a
    UsageError naming the difference (never a silently wrong model)."""
    if isinstance(encoding, (MRoPE, XDRoPE)):
        check_axes(encoding, rotary, model_type, kind)
    elif not isinstance(encoding, RoPE):
        return
    held_inv, factor = rotary_buffer(rotary, kind, family)
    if held_inv.is_meta or encoding.inv_freq.is_meta:  # a model being built by from_pretrained: checked once loaded
        return
    inv = held_inv.float().cpu()
    # At the buffer's own precision: a model cast with .to(torch.bfloat16) or .half() holds its
    # frequencies rounded to that dtype, so ours are rounded the same way and compared within its eps.
    held = held_inv.dtype if held_inv.is_floating_point() else torch.float32
    rtol = max(1e-5, torch.finfo(held).eps)
    ours = encoding.inv_freq.detach().to(held).float().cpu()
    name = family.name if family is not None else "this model"
    if (isinstance(encoding, RoPE) and family is not None and family.sincos_table is not None
            and ours.shape == inv.shape):  # every position of its table
        _check_table(encoding, _sincos_table(rotary, family), name, f"{type(rotary).__name__}.{family.sincos_table}")
    if ours.shape != inv.shape or not torch.allclose(ours, inv, rtol=rtol, atol=1e-9):
        raise UsageError(f"rope: posenc's RoPE read from the {name} config ({ours.numel()} frequencies) differs from the "
                         f"model's rotary module ({inv.numel()}) on layers of type {kind!r}; refusing a wrong model")
    ours_factor = encoding.attention_factor if isinstance(encoding, (RoPE, XDRoPE)) else 1.0
    if abs(ours_factor - factor) > 1e-6 * max(1.0, abs(factor)):
        raise UsageError(f"rope: posenc's attention factor {ours_factor} differs from the {name} model's "
                         f"{factor} on layers of type {kind!r}")


__all__ = ["check_rotation", "rotary_buffer", "rotary_tables", "verify_rope"]
