"""Multi-head self-attention: projections, the KV cache, and :func:`posenc.attend`.

The attention never tests an encoding's name: it calls ``rotate`` when the encoding has it, and the
backend asks the :class:`~posenc.call.spec.ScoreSpec` for bias and query/value terms.
``embed`` (absolute methods) is applied once by the model to the token embeddings, not here.
The KV cache (:class:`~posenc.model.cache.LayerCache`) lives in :mod:`posenc.model.cache`; it holds the
``num_kv_heads`` key/value heads, so its memory is proportional to them.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import backends
from ..backends.parts.windows import Extras
from ..call.axes import as_taken, check_takes_axes
from ..call.geometry import Geometry, check_positions
from ..call.memo import ForwardMemo
from ..encodings.base import PositionalEncoding, content_scale
from ..encodings.protocol import Curves, Gates, Rotates, Selects, offers, require
from ..encodings.query_scale import QueryScale
from ..errors import UsageError, check_positive
from ..functional import CURVES_ALONE, GATES_ALONE, SELECTS_ALONE, run, run_geometry
from .cache import LayerCache


class Attention(nn.Module):
    """x (B, T, dim) -> (B, T, dim), with positions from ``encoding``.

    Args:
        dim: model width; must be divisible by ``num_heads``.
        num_heads: number of query heads H; head dim D = dim // H.
        encoding: a positional encoding built for (num_heads, dim // num_heads), e.g.
            ``posenc.build("alibi", num_heads=8, head_dim=64)``.
        causal: mask keys after the query (decoder) or not (encoder).
        backend: "auto" or one of :func:`posenc.backends.names`.
        num_kv_heads: key/value heads Hkv (grouped-query attention; 1 is multi-query); None: H.
        window: sliding window W, or chunk: chunk size C (:mod:`posenc.backends.parts.windows`); None: full.
        sinks: one learned sink logit per head (``self.sinks`` (H,), zeros at first; gpt-oss).
        query_scale: a per-query factor of the positions (:mod:`posenc.encodings.query_scale`).

    Raises:
        UsageError: (when built) sizes that are not positive integers or do not divide, an encoding
            built for other sizes or another ``causal``, an unknown backend name, a window or chunk
            that is not a positive integer (or both); (when called) positions, documents or an
            attention mask that do not fit, documents or a mask with a KV cache, a windowed cache
            for forget gates, or a forced backend that cannot run the call (naming those that can).
    """

    def __init__(self, dim: int, num_heads: int, encoding: PositionalEncoding, causal: bool = True, backend: str = "auto",
                 num_kv_heads: int | None = None, *, window: int | None = None, chunk: int | None = None,
                 sinks: bool = False, query_scale: QueryScale | None = None) -> None:
        super().__init__()
        check_positive("dim", dim)
        check_positive("num_heads", num_heads)
        if dim % num_heads:
            raise UsageError(f"dim ({dim}) must be divisible by num_heads ({num_heads})")
        num_kv_heads = num_heads if num_kv_heads is None else check_positive("num_kv_heads", num_kv_heads)
        if num_heads % num_kv_heads:
            raise UsageError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.dim, self.num_heads, self.head_dim, self.num_kv_heads = dim, num_heads, dim // num_heads, num_kv_heads
        if getattr(encoding, "num_heads", num_heads) != num_heads or getattr(encoding, "head_dim", self.head_dim) != self.head_dim:
            raise UsageError(
                f"encoding was built for num_heads={encoding.num_heads}, head_dim={encoding.head_dim}; "
                f"this attention has num_heads={num_heads}, head_dim={self.head_dim}"
            )
        if getattr(encoding, "causal", causal) != causal:
            raise UsageError(f"encoding was built with causal={encoding.causal}, attention has causal={causal}")
        self.causal = causal
        self.backend = backends.check_name(backend)
        # The registered name of the backend that ran the last eager forward ("auto" resolved):
        # what benchmarks and users read to know which path ran (not written while compiling).
        self.last_backend: str | None = None
        self.encoding = encoding
        kv = num_kv_heads * self.head_dim
        # q (H*D), k (Hkv*D), v (Hkv*D). Any modules of these widths: posenc.hf.deberta sets a biased
        # qkv and an identity proj, posenc.bench identity for both.
        self.qkv: nn.Module = nn.Linear(dim, dim + 2 * kv, bias=False)
        self.proj: nn.Module = nn.Linear(dim, dim, bias=False)
        Extras(window, chunk, None, query_scale)  # checks them
        if offers(encoding, Gates) and (window is not None or chunk is not None or sinks):
            raise UsageError(GATES_ALONE)
        if offers(encoding, Curves) and (window is not None or chunk is not None or sinks):
            raise UsageError(CURVES_ALONE)
        if offers(encoding, Selects) and (window is not None or chunk is not None or sinks):
            raise UsageError(SELECTS_ALONE)
        self.window, self.chunk, self.query_scale = window, chunk, query_scale
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None  # (H,) logits

    @property
    def extras(self) -> Extras | None:
        """The window, chunk, sinks and query scale of this layer's calls (None: none of them)."""
        if self.window is None and self.chunk is None and self.sinks is None and self.query_scale is None:
            return None
        return Extras(self.window, self.chunk, self.sinks, self.query_scale)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        memo: ForwardMemo | None = None,
        *,
        document_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        geometry: Geometry | None = None,
    ) -> torch.Tensor:
        """x (B, T, dim) -> (B, T, dim).

        Args:
            positions: (T,) or (B, T) token positions (see :func:`posenc.attend`); with a cache,
                (T,) continuing it. For an encoding with ``position_axes`` > 1 also ids with an
                axis dimension, e.g. (3, B, T) for M-RoPE, with a cache too (each step's new
                tokens, free of the cache slots; the masks read the slots). A cache that has seen
                such ids continues each row at its own next id when ``positions`` is None
                (:meth:`posenc.model.cache.LayerCache.next_positions`, M-RoPE's max(id) + 1).
            cache: this layer's KV cache (decoding).
            memo: shared by the layers of one model forward.
            document_ids: (B, T) packed documents (no cache).
            attention_mask: (B, T) 1/True on real tokens, 0/False on padding (no cache; a cache
                takes its padding from ``new_cache(padding=...)``).
            geometry: the call's :class:`~posenc.call.geometry.Geometry`, built once by the model for
                all its layers; replaces ``positions``, ``document_ids`` and ``attention_mask``.
        """
        b, t, _ = x.shape
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv(x).split((h * d, hkv * d, hkv * d), dim=-1)
        q = q.view(b, t, h, d).transpose(1, 2)  # (B, H, T, D)
        k = k.view(b, t, hkv, d).transpose(1, 2)  # (B, Hkv, T, D)
        v = v.view(b, t, hkv, d).transpose(1, 2)
        memo = ForwardMemo() if memo is None else memo
        # Data-dependent forget gates (the Forgetting Transformer): one per token and head, from x.
        gates = self.encoding.log_gates(x) if offers(self.encoding, Gates) else None  # (B, H, T)
        scale = content_scale(self.encoding, d)  # 1/sqrt(D) unless the encoding says otherwise
        if cache is None:
            if geometry is None:
                mask = None if attention_mask is None else key_padding_mask_of(attention_mask)
                geometry = Geometry.of(b, t, t, x.device, positions=positions, causal=self.causal,
                                       document_ids=document_ids, key_padding_mask=mask, encoding=self.encoding)
            curves = self._curves(x, geometry)  # (B, H, T, R): the Inkling bias of each query, from x
            out, name = run_geometry(q, k, v, self.encoding, geometry, scale, memo, self.backend, True, self.extras, gates, curves)
        else:
            if document_ids is not None or attention_mask is not None:
                raise UsageError("document_ids and attention_mask take no KV cache (a cache's padding comes from new_cache(padding=...))")
            out, name = self._cached(q, k, v, positions, cache, memo, scale, geometry, gates, x)
        if not torch.compiler.is_compiling():
            self.last_backend = name
        return self.proj(out.transpose(1, 2).reshape(b, t, self.dim))

    def _curves(self, x: torch.Tensor, geometry: Geometry) -> torch.Tensor | None:
        """Per-query bias curves (B, H, T, R) of an encoding with the Curves hook, from the layer input
        at the queries' positions (their own: a KV cache keeps nothing for them); else None."""
        if not offers(self.encoding, Curves):
            return None
        return self.encoding.query_curves(x, geometry.q_positions)

    def _cached(self, q, k, v, positions, cache: LayerCache, memo, scale, geometry, gates=None, x=None) -> tuple[torch.Tensor, str]:
        """A step after the KV cache: rotate (unless the rotation depends on the length), append, attend."""
        b, t = q.shape[0], q.shape[-2]
        past = cache.length
        cache.claim(self)
        if geometry is None:
            geometry = Geometry.step(b, t, past, q.device, positions=positions, encoding=self.encoding,
                                     next_positions=cache.next_positions())
        positions, axes = geometry.q_positions, geometry.q_axes
        check_takes_axes(self.encoding, axes)
        rotates = offers(self.encoding, Rotates)
        # A rotation that depends on the current length (dynamic NTK, LongRoPE's short/long switch)
        # must rotate every key with the current length: the cache keeps such keys un-rotated and
        # they are rotated at each step (O(T x D) per step), so decoding equals the full pass.
        late = rotates and getattr(self.encoding, "rotation_depends_on_length", False)
        rotation = require(self.encoding, Rotates) if rotates else None
        if late and axes is not None:  # its keys would be re-rotated at the slots: refuse, never a silent wrong rotation
            raise UsageError(f"positions with an axis dimension cannot decode with {type(self.encoding).__name__}, whose rotation "
                             "depends on the length (its cached keys are rotated again at every step, at the cache slots)")
        if rotation is not None and not late:
            # New q and k at their own ids (the slots with 1-D positions); cached keys keep theirs.
            at = positions if axes is None else as_taken(self.encoding, axes)
            if axes is None and cache.padding is not None and any(cache.padding) and not self.encoding.shift_invariant:
                # A rotation of absolute positions (FoPE): each left-padded row turns at its own positions, counted
                # from its first real token as the full pass counts them (its padding slots clamped to 0: masked).
                turned = [rotation.rotate(q[b : b + 1], k[b : b + 1], (at - pad).clamp_min(0), (at - pad).clamp_min(0))
                          for b, pad in enumerate(cache.padding)]
                q, k = torch.cat([t[0] for t in turned]), torch.cat([t[1] for t in turned])
            else:
                q, k = rotation.rotate(q, k, at, at)
        k, v = cache.append(k, v)  # (B, Hkv, past + T, D): views of the cache's buffers
        if axes is not None:
            cache.note_positions(axes)  # each row's next id, for a later step without positions
        if gates is not None:
            if cache.window is not None:
                raise UsageError("an encoding with forget gates (log_gates) cannot decode with a windowed cache (window=...)")
            gates = cache.append_gates(gates)  # (B, H, past + T): every cached key's log gate
        k_positions = cache.positions(q.device)  # start..past+T-1, a view (nothing per step grows with N)
        if rotation is not None and late:
            # An encoding that keeps cached keys in a frame of its own (xPos's centre) rotates only the new ones.
            # (Not for a windowed cache: it forgets its oldest rows, so rows are no longer positions;
            # its at most 2W keys are rotated afresh each step.)
            in_frame = getattr(self.encoding, "rotate_in_frame", None)
            if callable(in_frame) and cache.window is None:
                q, k = in_frame(q, k, positions, k_positions, cache)
            else:
                q, k = rotation.rotate(q, k, positions, k_positions)
        spec = geometry.cached_spec(self.encoding, scale, memo, causal=self.causal, k_positions=k_positions, k_start=cache.start,
                                    starts=cache.starts(q.device), workspace=cache.workspace, log_gates=gates,
                                    curves=None if x is None else self._curves(x, geometry))
        if spec.selective:  # selective attention: the cache keeps each key's selection summed over the queries so far
            if cache.window is not None:
                raise UsageError("selective attention cannot decode with a windowed cache (window=...)")
            spec.selected = cache.selected_sums(k.shape[-2], t)  # (B, past + T): the earlier calls' sums, 0 for the new keys
            out = run(q, k, v, spec, self.backend, rotate=False, extras=self.extras)
            now = spec.selection(q, k).sum(1)  # (B, past + T): this call's queries' selection of every key
            cache.selected = now if spec.selected is None else spec.selected + now
            return out
        return run(q, k, v, spec, self.backend, rotate=False, extras=self.extras)


def key_padding_mask_of(attention_mask: torch.Tensor) -> torch.Tensor:
    """HF's (B, T) attention mask (1 = real token) as a bool key padding mask."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        raise UsageError(f"attention_mask must be a (batch, length) tensor of 0/1 or bool, got {getattr(attention_mask, 'shape', attention_mask)}")
    if attention_mask.dtype == torch.bool:
        return attention_mask
    if attention_mask.is_floating_point() or attention_mask.is_complex() or bool(((attention_mask != 0) & (attention_mask != 1)).any()):
        raise UsageError("attention_mask must hold 0 (padding) and 1 (real token) only")
    return attention_mask == 1


__all__ = ["Attention", "check_positions", "key_padding_mask_of"]
