"""TEMPORARY: a dense stand-in for ``posenc.attend`` until the functional call lands on main.

Installed as ``posenc.functional`` only when that module does not exist. Dense, row by row, from the
encoding's hooks; the semantics of the brief: q (B, H, Tq, D), k/v (B, Hkv, Tk, D), positions
(Tq,) or (B, Tq), k_positions (Tk,) or (B, Tk), document_ids (B, T), key_padding_mask (B, Tk).
"""

from __future__ import annotations

import sys
import types

import torch

from posenc.encodings.protocol import Biases, QueryTerms, Rotates, ValueTerms, offers


def attend(q, k, v, encoding=None, *, positions=None, k_positions=None, causal=True, scale=None,
           document_ids=None, key_padding_mask=None, rotate=True, backend="auto"):
    b, h, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    k = k.repeat_interleave(h // hkv, dim=1)
    v = v.repeat_interleave(h // hkv, dim=1)
    scale = d ** -0.5 if scale is None else scale
    if positions is None:
        positions = torch.arange(tk - tq, tk)
    positions = positions.expand(b, tq) if positions.dim() == 1 else positions
    if k_positions is None:
        k_positions = positions[:, -1:] - torch.arange(tk - 1, -1, -1)
    k_positions = k_positions.expand(b, tk) if k_positions.dim() == 1 else k_positions
    outs = []
    for r in range(b):
        qp, kp = positions[r], k_positions[r]
        qb, kb, vb = q[r: r + 1], k[r: r + 1], v[r: r + 1]
        if encoding is not None and rotate and offers(encoding, Rotates):
            qb, kb = encoding.rotate(qb, kb, qp, kp)
        s = (qb @ kb.transpose(-1, -2)).float() * scale
        if encoding is not None and offers(encoding, Biases):
            s = s + encoding.bias(qp, kp)
        if encoding is not None and offers(encoding, QueryTerms):
            s = s + encoding.query_terms(qb, kb, qp, kp)
        allowed = torch.ones(tq, tk, dtype=torch.bool)
        if causal:
            allowed &= torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + (tk - tq)
        if document_ids is not None:
            allowed &= document_ids[r][:, None] == document_ids[r][None, :]
        if key_padding_mask is not None:
            allowed &= key_padding_mask[r][None, :]
        p = s.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0).to(vb.dtype)
        o = p @ vb
        if encoding is not None and offers(encoding, ValueTerms):
            o = o + encoding.value_terms(p, qp, kp)
        if key_padding_mask is not None:
            o = o * key_padding_mask[r][tk - tq:].to(o.dtype)[None, None, :, None]
        outs.append(o)
    return torch.cat(outs)


def install() -> None:
    try:
        import posenc.functional  # noqa: F401
    except ImportError:
        module = types.ModuleType("posenc.functional")
        module.attend = attend
        sys.modules["posenc.functional"] = module
