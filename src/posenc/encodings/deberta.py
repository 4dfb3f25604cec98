"""DeBERTa's disentangled attention (He, Liu, Gao & Chen 2020, "DeBERTa: Decoding-enhanced BERT
with Disentangled Attention", §3.1, eq. 2-4; the v2/v3 log buckets of the authors' release).

Each token is a content vector and a relative position. Beside the content score q_i . k_j, the
attention scores the query's content against the *relative position key* of the pair
(content-to-position, c2p) and the key's content against the *relative position query* of the pair
(position-to-content, p2c):

    A_ij = q_i . k_j  +  q_i . K_r[idx_ij]  +  k_j . Q_r[idx_ij]                      (eq. 4)
    out  = softmax(A / sqrt(D * (1 + n))) v                                           (eq. 4, "scale")

where n is the number of position terms used (``pos_att_type``: c2p, p2c or both), and
K_r = P W_kr + b_kr, Q_r = P W_qr + b_qr are one relative table P (2k, dim) (through a LayerNorm
in v2/v3) passed through position key/query projections (dim -> H x D, per layer). Shape legend:
B batch, H heads, Tq / Tk queries / keys, D head dim, dim = H x D, 2k table rows.

Relative index. With delta = i - j (query minus key position, the opposite sign of posenc's
r = j - i), idx_ij = clamp(bucket(delta) + k, 0, 2k - 1). v2/v3 buckets (``position_buckets``
b > 0, span k = b, ``max_relative_positions`` M): with mid = b // 2, bucket(delta) = delta for
|delta| <= mid, else sign(delta) * (mid + ceil(ln(|delta| / mid) / ln((M - 1) / mid) * (mid - 1))),
computed in float32 (the bucket edges then agree with Hugging Face's ``make_log_bucket_position``
at every distance; the float64 formula moves a few edges for unusual (b, M), e.g. b = 512,
M = 4096 at |delta| = 1643). v1's unbucketed form (``position_buckets=0``): bucket(delta) = delta,
span k = M. Either way the index is non-decreasing in delta and saturates: every key far enough in
the past (delta >= some P) uses row 2k - 1 and every key far enough in the future row 0, as Shaw's
clipped keys do.

Conventions, where the paper and the code differ:

- p2c index. The paper writes the p2c term with delta(j, i); the authors' code (and Hugging Face's
  ``DisentangledSelfAttention``, which follows it) gathers the key-side products at -delta(j, i)
  and transposes, which is the index of c2p, delta(i, j). Pretrained checkpoints were trained with
  the code's form, so posenc uses it: both terms read row idx_ij.
- Unequal query and key lengths. Hugging Face's ``disentangled_attention_bias`` passes
  ``max_relative_positions`` and ``position_buckets`` to ``build_rpos`` in swapped order (and uses
  key-to-key distances), which matters only when Tq != Tk. posenc computes idx_ij from the actual
  positions of query i and key j with the one bucket function, as the authors' code does, for any
  Tq and Tk (a KV cache's decode steps included).
- Scale. The content product is scaled by 1 / sqrt(D * (1 + n)), not 1 / sqrt(D): the encoding
  says so with its plain attribute ``content_scale``, which the attention reads (no name test), and
  applies the same factor to its own terms, which are in logit units as every score term is.
- Sharing. The paper shares P across layers and, with ``share_att_key``, uses the layer's own
  content key/query projections for K_r and Q_r. A posenc encoding sees projected q and k only, so
  every layer's encoding holds its own P (LayerNorm included) and position projections
  (learned parameters: ``shares_across_layers`` is False); ``posenc.hf.deberta_from_hf`` copies the encoder's one table
  and, for ``share_att_key``, the layer's key/query projections into them, which computes the same
  function.

The paper's model is an encoder (bidirectional); ``causal=True`` masks keys after the query and
keeps the same terms (the future rows of the table are then never read). No (Tq, Tk, D) tensor is
built: q and k are multiplied with the 2k position keys/queries once, (B, H, T, 2k), and gathered
per pair (for one query against a cache, the p2c rows are gathered per key instead).

Backends. ``query_terms`` is the reference (``eager``: (B, H, 256, Tk) per query block). The
encoding also offers ``DisentangledTables`` (``disentangled_tables`` and ``relative_rows``), which
``terms`` serves on CPU in float32/float64 (``backends/parts/disentangled.py``, docs/backends.md):
every key past the last bucket on one side reads one row t (2k - 1 in the past, 0 in the future),
so for those keys A_ij / sqrt(D (1 + n)) = ((q_i + Q_r[t]) . k_j + q_i . K_r[t]) / sqrt(D (1 + n)),
plain attention of a shifted query plus a per-query constant (the flash kernel); only the band of
distinct buckets is written out, its position terms one (T x W) matrix per head (W band distances); a
decode step (causal form, KV cache) is the same split for one query.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import UsageError, check_positive
from .base import PositionalEncoding
from .protocol import DisentangledForm

TERMS = ("c2p", "p2c")


def log_bucket(delta: torch.Tensor, buckets: int, max_position: int) -> torch.Tensor:
    """DeBERTa-v2 log buckets of integer ``delta`` = i - j (any shape): same shape, sign kept.

    Exact for |delta| <= buckets // 2, logarithmic beyond, reaching buckets - 1 at
    |delta| = max_position - 1 and growing past it (the index clamp saturates it). In float32, as
    the released implementations compute it. ``buckets <= 0``: delta itself (DeBERTa v1).
    """
    if buckets <= 0:
        return delta
    mid = buckets // 2
    distance = delta.abs()
    # ln(|delta| / mid) / ln((M - 1) / mid), in float32; distances inside the exact range are
    # replaced by mid (their ratio is not used) so the logarithm never sees 0.
    ratio = torch.where(distance > mid, distance, torch.full_like(distance, mid)).float() / mid
    ratio_max = torch.tensor((max_position - 1) / mid, dtype=torch.float32, device=delta.device)
    far = torch.ceil(torch.log(ratio) / torch.log(ratio_max) * (mid - 1)).long() + mid
    return torch.where(distance <= mid, delta, far * delta.sign())


class DeBERTa(PositionalEncoding):
    """Content-to-position and position-to-content terms over a relative table (DeBERTa v2/v3)."""

    name = "deberta"
    description = "disentangled attention: c2p and p2c terms over a log-bucketed relative table (He et al. 2020)"
    extrapolates = True  # distances past the last bucket share the table's end rows
    shift_invariant = True  # positions enter as i - j only
    # not shared across layers (derived from its learned parameters): each layer has its own position projections (and table, see above)

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        causal: bool = False,
        position_buckets: int = 256,
        max_relative_positions: int = 512,
        pos_att_type: str = "c2p|p2c",
        layer_norm: bool = True,
        layer_norm_eps: float = 1e-7,
    ) -> None:
        super().__init__(num_heads, head_dim, causal)
        if isinstance(position_buckets, bool) or not isinstance(position_buckets, int) or position_buckets < 0:
            raise UsageError(f"position_buckets must be an integer >= 0 (0: v1's unbucketed distances), got {position_buckets!r}")
        self.position_buckets = position_buckets
        self.max_relative_positions = check_positive("max_relative_positions", max_relative_positions)
        if position_buckets:
            if position_buckets < 2:
                raise UsageError(f"position_buckets must be >= 2 (or 0 for v1's unbucketed distances), got {position_buckets}")
            if max_relative_positions - 1 <= position_buckets // 2:
                raise UsageError(
                    f"max_relative_positions must be > position_buckets // 2 + 1 = {position_buckets // 2 + 1} "
                    f"(the log buckets start past the exact range), got {max_relative_positions}"
                )
        terms = [t.strip() for t in str(pos_att_type).lower().split("|") if t.strip()] if isinstance(pos_att_type, str) else None
        if not terms or any(t not in TERMS for t in terms) or len(set(terms)) != len(terms):
            raise UsageError(f"pos_att_type must be 'c2p', 'p2c' or 'c2p|p2c', got {pos_att_type!r}")
        self.pos_att_type = "|".join(t for t in TERMS if t in terms)
        if not isinstance(layer_norm, bool):
            raise UsageError(f"layer_norm must be True or False, got {layer_norm!r}")
        if not (isinstance(layer_norm_eps, (int, float)) and not isinstance(layer_norm_eps, bool) and layer_norm_eps > 0):
            raise UsageError(f"layer_norm_eps must be a number > 0, got {layer_norm_eps!r}")
        self.span = position_buckets if position_buckets else max_relative_positions  # k
        dim = self.dim
        self.rel_embeddings = nn.Parameter(torch.randn(2 * self.span, dim) * 0.02)  # P (2k, dim)
        self.norm = nn.LayerNorm(dim, eps=float(layer_norm_eps)) if layer_norm else None
        self.pos_key_proj = nn.Linear(dim, dim) if "c2p" in terms else None  # W_kr, b_kr
        self.pos_query_proj = nn.Linear(dim, dim) if "p2c" in terms else None  # W_qr, b_qr
        self.num_terms = len(terms)

    @property
    def content_scale(self) -> float:
        """The factor of q . k: 1 / sqrt(D * (1 + number of position terms)) (eq. 4)."""
        return 1.0 / math.sqrt(self.head_dim * (1 + self.num_terms))

    def relative_rows(self, relative: torch.Tensor) -> torch.Tensor:
        """Table rows of integer r = j - i (posenc's sign, any shape): clamp(bucket(-r) + k, 0, 2k - 1).

        Non-increasing in r and constant on each side far enough out (row 2k - 1 in the past,
        row 0 in the future, or the rows the buckets saturate at when b < 4): the fast backend
        finds those ends per call from this function alone (``backends/parts/disentangled.py``).
        """
        bucket = log_bucket(-relative, self.position_buckets, self.max_relative_positions)
        return (bucket + self.span).clamp(0, 2 * self.span - 1)

    def index(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        """(Tq, Tk) table rows idx_ij = clamp(bucket(i - j) + k, 0, 2k - 1)."""
        return self.relative_rows(k_positions[None, :] - q_positions[:, None])  # r = j - i = -delta

    def table(self) -> torch.Tensor:
        """The relative table as the projections see it: LayerNorm(P) (2k, dim), or P."""
        return self.rel_embeddings if self.norm is None else self.norm(self.rel_embeddings)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(-1, self.num_heads, self.head_dim).transpose(0, 1)  # (2k, H*D) -> (H, 2k, D)

    def position_tables(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(K_r, Q_r), each (H, 2k, D) or None when its term is not used."""
        p = self.table()
        kr = None if self.pos_key_proj is None else self._heads(self.pos_key_proj(p))
        qr = None if self.pos_query_proj is None else self._heads(self.pos_query_proj(p))
        return kr, qr

    def disentangled_tables(self) -> DisentangledForm:
        """What ``query_terms`` is made of, for the fast backend (:class:`DisentangledTables`).

        Returns a :class:`~posenc.encodings.protocol.DisentangledForm` (query table K_r (H, 2k, D)
        or None, key table Q_r (H, 2k, D) or None, scale): the pair (i, j) reads row t =
        ``relative_rows(j - i)`` and its term is (q_i . K_r[t] + k_j . Q_r[t]) * scale.
        """
        kr, qr = self.position_tables()
        return DisentangledForm(kr, qr, self.content_scale)

    def query_terms(
        self, q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor
    ) -> torch.Tensor:
        """(c2p + p2c) * content_scale, (B, H, Tq, Tk), in logit units."""
        b, h, tq, _ = q.shape
        tk = k.shape[-2]
        idx = self.index(q_positions, k_positions)  # (Tq, Tk)
        kr, qr = self.position_tables()
        terms = None
        if kr is not None:  # c2p: q_i . K_r[idx_ij]
            per_row = torch.matmul(q, kr.to(q.dtype).transpose(-1, -2))  # (B, H, Tq, 2k)
            terms = per_row.gather(-1, idx.expand(b, h, tq, tk))
        if qr is not None:  # p2c: k_j . Q_r[idx_ij]
            qr = qr.to(k.dtype)
            if tq == 1:  # one query (a decode step): the rows each key needs, (H, Tk, D)
                p2c = (k * qr[:, idx[0]]).sum(-1)[:, :, None, :]  # (B, H, 1, Tk)
            else:
                per_key = torch.matmul(k, qr.transpose(-1, -2))  # (B, H, Tk, 2k)
                p2c = per_key.transpose(-1, -2).gather(-2, idx.expand(b, h, tq, tk))  # [i, j] = per_key[j, idx_ij]
            terms = p2c if terms is None else terms + p2c
        if terms is None:  # neither term (the constructor asks for one): no position term at all
            return q.new_zeros(b, h, tq, tk)
        return terms * self.content_scale

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, position_buckets={self.position_buckets}, "
                f"max_relative_positions={self.max_relative_positions}, pos_att_type={self.pos_att_type!r}, "
                f"layer_norm={self.norm is not None}")


__all__ = ["DeBERTa", "log_bucket"]
