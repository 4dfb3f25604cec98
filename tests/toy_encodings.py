"""Two encodings that exist only in the tests, for what no registered method does:

- :class:`LengthScaledRoPE`: a rotation whose frequencies depend on the current length (as dynamic
  NTK scaling does), so the KV cache must keep its keys un-rotated (``rotation_depends_on_length``);
- :class:`AbsoluteKeyBias`: a bias of the key's absolute position, not of i - j, so rows that share
  positions under left padding would not get what they get alone (``shift_invariant`` False).

``registered(monkeypatch)`` adds both to the registry for one test, so ``LMConfig`` can build them.
"""

from __future__ import annotations

import torch

from posenc import encodings
from posenc.encodings.base import PositionalEncoding, bias_from_score
from posenc.encodings.rope import RoPE


class LengthScaledRoPE(RoPE):
    """RoPE whose base grows with the current length L (largest key position + 1): base * (1 + L / 8)."""

    name = "toy_scaled_rope"
    rotation_depends_on_length = True
    shift_invariant = False

    def rotate(self, q, k, q_positions, k_positions):
        length = int(k_positions.max()) + 1
        d = self.rotary_dim
        inv_freq = (self.base * (1 + length / 8)) ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)

        def turn(x, positions):
            angles = (positions.double()[:, None] * inv_freq[None, :]).to(x.device)  # (T, d/2)
            cos, sin = angles.cos().float(), angles.sin().float()
            x1, x2 = x[..., : d // 2].float(), x[..., d // 2 :].float()
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

        return turn(q, q_positions), turn(k, k_positions)


class AbsoluteKeyBias(PositionalEncoding):
    """bias(h, i, j) = 0.8 sin(0.7 j + h): depends on the key's absolute position."""

    name = "toy_absolute_key"
    description = "test only"
    shift_invariant = False

    def score(self, h, i, j):
        return 0.8 * torch.sin(0.7 * j.float() + h.float()) + 0.0 * i.float()

    def bias(self, q_positions, k_positions):
        return bias_from_score(self, q_positions, k_positions)  # (H, Tq, Tk)


TOYS = (LengthScaledRoPE, AbsoluteKeyBias)


def registered(monkeypatch) -> None:
    for cls in TOYS:
        monkeypatch.setitem(encodings.REGISTRY, cls.name, cls)
