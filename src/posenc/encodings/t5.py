"""T5 relative position bias (Raffel et al. 2020, "Exploring the Limits of Transfer Learning...", §2.1).

One learned scalar per head and *bucket* of relative position r = j - i, added to the attention
scores. Buckets are exact near zero and logarithmic further out, up to ``max_distance``, past which
every distance shares the last bucket. An encoder (bidirectional) spends half the buckets on each
side, keys after the query (r > 0) in the upper half; a causal decoder uses all buckets for the
past and maps r > 0 to bucket 0. The bias is computed once per forward pass and shared by every
layer, as in T5.

The bucket function follows the original Mesh TensorFlow definition, so a table trained by T5 (or
Hugging Face's T5) drops in. Some explanations draw the bidirectional table mirrored, with the past
in the upper half; this module uses the checkpoint-compatible convention.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import UsageError, check_positive
from .base import PositionalEncoding, check_bias_positions
from .protocol import BiasTails


def relative_position_bucket(
    relative_position: torch.Tensor,
    *,
    bidirectional: bool,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> torch.Tensor:
    """Map relative positions r = j - i (LongTensor, any shape) to T5 buckets (same shape).

    Per side, with ``n`` buckets and ``exact = n // 2``: distances 0..exact-1 get one bucket each,
    distances exact..max_distance-1 are spread logarithmically over the remaining buckets, and
    distances >= max_distance fall in the last one. Example, 16 buckets a side, max distance 128:
    0..7 -> 0..7, 16 -> 10, 32 -> 12, 64 -> 14, >= 128 -> 15.
    """
    check_positive("num_buckets", num_buckets)
    per_side = num_buckets // 2 if bidirectional else num_buckets
    exact = per_side // 2
    if exact < 1:
        raise UsageError(
            f"num_buckets must be >= {4 if bidirectional else 2} "
            f"({'bidirectional' if bidirectional else 'causal'}), got {num_buckets}"
        )
    if max_distance <= exact:
        raise UsageError(
            f"max_distance must be above the exact range ({exact} distances get their own bucket "
            f"with num_buckets={num_buckets}), got {max_distance}"
        )
    relative_position = torch.as_tensor(relative_position)
    if relative_position.is_floating_point():
        raise UsageError("relative_position must be an integer tensor")
    relative_position = relative_position.long()
    if bidirectional:
        offset = (relative_position > 0).long() * per_side  # keys after the query: upper half
        distance = relative_position.abs()
    else:
        offset = torch.zeros_like(relative_position)
        distance = (-relative_position).clamp(min=0)  # only the past counts; the future -> 0
    # Log-spaced buckets for distance >= exact, in float32 as in the original implementation, so
    # that bucket edges agree with trained checkpoints to the last distance.
    log_ratio = torch.log(distance.float() / exact) / math.log(max_distance / exact)
    far = exact + (log_ratio * (per_side - exact)).long()
    far = far.clamp(max=per_side - 1)
    return offset + torch.where(distance < exact, distance, far)


def _steps_by_one(positions: torch.Tensor) -> bool:
    """Increasing positions that skip no value (their ends say so)."""
    return positions.numel() < 2 or int(positions[-1] - positions[0]) == positions.numel() - 1


class T5Bias(PositionalEncoding):
    """Learned scalar bias per (bucket, head); table layout (num_buckets, H) as in T5 checkpoints."""

    name = "t5"
    description = "learned scalar bias per head and log-spaced relative-distance bucket (Raffel et al. 2020)"
    extrapolates = True
    shift_invariant = True  # positions enter as i - j only
    shares_parameters = True  # one table for all layers, as in T5

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        causal: bool = True,
        num_buckets: int = 32,
        max_distance: int = 128,
    ) -> None:
        super().__init__(num_heads, head_dim, causal)
        self.num_buckets = check_positive("num_buckets", num_buckets)
        self.max_distance = check_positive("max_distance", max_distance)
        # Validate the combination now rather than at the first forward.
        relative_position_bucket(
            torch.zeros(1, dtype=torch.long),
            bidirectional=not causal,
            num_buckets=num_buckets,
            max_distance=max_distance,
        )
        self.relative_attention_bias = nn.Embedding(num_buckets, num_heads)  # (buckets, H)
        nn.init.normal_(self.relative_attention_bias.weight, std=0.02)
        self._bucket_cache: dict[tuple[object, ...], torch.Tensor] = {}

    def buckets(self, relative_position: torch.Tensor) -> torch.Tensor:
        return relative_position_bucket(
            relative_position,
            bidirectional=not self.causal,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )

    def score(self, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        return self.relative_attention_bias.weight[self.buckets(j - i), h]

    def bucket_table(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        """(Tq, Tk) bucket indices, cached per (query length, key length, offset, device) for
        consecutive positions (the geometry then fixes the table)."""
        tq, tk = q_positions.numel(), k_positions.numel()
        if not (_steps_by_one(q_positions) and _steps_by_one(k_positions)):  # randomized positions
            return self.buckets(k_positions[None, :] - q_positions[:, None])
        offset = int(k_positions[0] - q_positions[0]) if tq and tk else 0
        key = (tq, tk, offset, q_positions.device)
        table = self._bucket_cache.get(key)
        if table is None:
            if len(self._bucket_cache) > 64:  # bounded: decoding produces one key per step
                self._bucket_cache.clear()
            relative = k_positions[None, :] - q_positions[:, None]  # (Tq, Tk)
            table = self._bucket_cache[key] = self.buckets(relative)
        return table

    def bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        check_bias_positions(self, q_positions, k_positions)
        return self._values(self.bucket_table(q_positions, k_positions))  # (H, Tq, Tk)

    def _values(self, buckets: torch.Tensor) -> torch.Tensor:
        """(H, *buckets.shape): each head's value of each bucket. A selection along the table's
        transpose (the same numbers as the embedding lookup, heads first): its gradient is one
        index_add per head, where the embedding's backward over a (Tq, Tk) table of buckets is
        several times slower on CPU."""
        weight = self.relative_attention_bias.weight  # (buckets, H)
        return weight.t().index_select(1, buckets.reshape(-1)).view(weight.shape[1], *buckets.shape)

    # Capabilities for the fast backends (see PositionalEncoding). The bias is piecewise constant
    # in r = j - i, and every distance from the last bucket's first one on shares one value per
    # head: beyond that band, attention is plain attention plus a per-head constant.
    def relative_bias(self, relative: torch.Tensor) -> torch.Tensor:
        return self._values(self.buckets(relative))  # (H, *r.shape)

    def bias_tails(self) -> BiasTails:
        tails = getattr(self, "_tails", None)  # a function of the fixed sizes: computed once
        if tails is None:
            distances = torch.arange(self.max_distance + 1)  # the last bucket starts by max_distance
            past = self.buckets(-distances)
            past_start = int(torch.nonzero(past == past[-1])[0])
            if self.causal:
                future_start = 1  # every key after the query is bucket 0 (and masked)
            else:
                future = self.buckets(distances)
                future_start = int(torch.nonzero(future == future[-1])[0])
            tails = self._tails = BiasTails(past=past_start, past_slope=None, future=future_start, future_slope=None)
        return tails


__all__ = ["T5Bias", "relative_position_bucket"]
