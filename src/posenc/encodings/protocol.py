"""The contract between encodings and the attention: hooks and optional capabilities, as Protocols.

An encoding is an ``nn.Module`` that implements any subset of the *hooks*; the attention and the
backends find them with :func:`offers` and never ask an encoding for its name, so a new method is
one new file plus one registry line. Each hook or capability is a runtime-checkable
``typing.Protocol``; :func:`offers` is the one check used everywhere.

Hooks, in the order a model calls them (shape legend: B batch, H heads, T / Tq / Tk lengths, D head
dim; positions are 1-D integer tensors of strictly increasing absolute indices, usually consecutive;
randomized positions skip values, and fast backends that assume steps of one then step aside):

- :class:`Embeds` ``embed(x, positions) -> x``: absolute information added to the token embeddings
  x (B, T, dim); called once by the model on its input, not by every attention layer.
- :class:`Rotates` ``rotate(q, k, q_positions, k_positions) -> (q, k)``: queries and keys
  transformed before the content product (RoPE and its family); the returned q and k share one head
  size, which may differ from the values' (PoPE widens them to 2 D features).
- :class:`Biases` ``bias(q_positions, k_positions) -> (H, Tq, Tk)``: an additive score bias, the
  same for every item of the batch (T5, ALiBi and the biases after them).
- :class:`QueryTerms` ``query_terms(q, k, q_positions, k_positions) -> (B, H, Tq, Tk)``: score
  terms that depend on the queries or keys (Shaw, Transformer-XL).
- :class:`ValueTerms` ``value_terms(probs, q_positions, k_positions) -> (B, H, Tq, D)``: added
  to the output, for methods that also move values (Shaw).
- :class:`Gates` ``log_gates(x) -> (B, H, T)``: data-dependent forget gates, log f_t <= 0, of every
  token from the attention layer's input x (B, T, dim); called by ``posenc.Attention`` on its input
  (``posenc.attend`` takes them as ``log_gates``), kept in the KV cache beside the keys. The score
  of query i and key j gains sum_{l=j+1..i} log f_l (the Forgetting Transformer).
- :class:`Curves` ``query_curves(x, positions) -> (B, H, T, R)``: data-dependent per-query
  biases over backward distance (the Inkling bias), from the attention layer's input x (B, T, dim)
  at the queries' positions; called by ``posenc.Attention`` on its input (``posenc.attend`` takes them
  as ``query_curves``). Query i and key j gain curves[i, p_i - p_j] for 0 <= p_i - p_j < R, nothing
  otherwise. They belong to the queries: a KV cache keeps nothing for them.
- :class:`Selects` ``selection_scores(q, k) -> (B, Tq, Tk)``: selective attention (Leviathan et
  al. 2024): the content scores of the head that selects, in logits; the backend turns them into
  S = relu(scores) (0 on the diagonal, on the first key and on hidden keys) and subtracts from every
  head's logits the sum of S over the earlier queries, F_ij = sum_{t<i} S_tj. A KV cache keeps each
  key's running sum of S (``ScoreSpec.selected``), so a decode step sees every earlier query's.
- :class:`Remaps` ``regions(q_positions, k_positions) -> [RemapRegion]`` and ``rotate_at(x,
  positions)``: a rotation whose positions depend on the pair (SelfExtend, ReRoPE, STRING, DCA): each
  region is a set of keys per query with its own query and key positions; the attention rotates q
  and k per region and merges the regions' softmax parts exactly (``backends/parts/remapped.py``).
  Such an encoding offers no ``rotate``: its KV cache keeps un-rotated keys.

Every score term is in *logit units*: the attention computes ``softmax(q k^T * scale + bias +
query_terms) v + value_terms`` with ``scale = 1/sqrt(D)``; a paper that scales its own terms has the
encoding apply that scale itself.

Capabilities are optional descriptions of the same function that let a fast backend skip the
(H, N, N) tensor. They never change the result: the hooks stay the reference every backend is
tested against.

- :class:`Scores`: ``score(h, i, j)``, the bias as a scalar function, elementwise over
  broadcastable integer tensors of head, query position and key position: a fused kernel's score
  modifier (``backends/flex.py``). Every bias method of posenc offers it but the dynamic position
  bias (its MLP, run per pair, would cost a W x W product per score: ``blocked`` runs it instead).
- :class:`DistanceBias`: ``relative_bias(r) -> (H, *r.shape)``: a bias that depends on r = j - i
  alone (KERPLE, the dynamic position bias), so a backend needs one vector per head, not an (H, N, N) tensor
  (``backends/parts/explicit.py``).
- :class:`RelativeBias`: ``relative_bias(r) -> (H, *r.shape)`` and ``bias_tails() -> BiasTails``:
  a bias that depends on r = j - i alone and, past some distance, is constant or linear in r (T5's
  last bucket, ALiBi), so far keys can go through a fused kernel (``backends/blocked.py``).
- :class:`ClippedTables`: ``clipped_tables() -> ClipTables`` (Shaw): clip k, key and value
  tables, scale.
- :class:`DistanceKeys`: ``distance_key_form() -> DistanceKeyForm`` (u, v, scale) and
  ``position_keys(distances, dtype)`` (Transformer-XL): one position key per distance
  (``backends/terms.py``).
- :class:`DisentangledTables`: ``disentangled_tables() -> DisentangledForm`` (query_table (H, R,
  D) or None, key_table (H, R, D) or None, scale) and ``relative_rows(r) -> rows`` (DeBERTa): query
  terms ``(q_i . query_table[t] + k_j . key_table[t]) * scale`` at row t = relative_rows(j - i); the
  backend finds, per call, where the rows stop changing on each side, so far keys are plain
  attention with a per-query constant and a per-head shift of q (``backends/parts/disentangled.py``).
- :class:`BiasFeatures`: ``bias_features(q_positions, k_positions) -> (qf (H, Tq, F), kf (H, Tk,
  F))`` with ``bias = qf @ kf^T`` up to a per-query constant: an exactly low-rank bias that plain
  SDPA runs as F extra features on q and k (``backends/features.py``).
- :class:`ContextualPositions`: ``contextual_positions() -> ContextualForm`` (table (P, D),
  gate_scale, logit_scale) (CoPE): query terms that are q_i . table[p] * logit_scale interpolated at the
  fractional position p_ij = min(sum_{t=j..i} sigmoid(q_i . k_t * gate_scale), P - 1); every key
  whose count reaches P - 1 gets one per-query constant, so far keys are plain attention
  (``backends/contextual.py``).

Plain attributes complete the contract (see :class:`~posenc.encodings.base.PositionalEncoding`):
``max_positions``, ``shares_across_layers``, ``causal_only``, ``extrapolates``,
``rotation_depends_on_length``, ``shift_invariant``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

import torch

if TYPE_CHECKING:  # typing.TypeIs is Python 3.13's; typing_extensions is only needed by the type checker
    from typing_extensions import TypeIs

C = TypeVar("C")


@runtime_checkable
class Embeds(Protocol):
    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class Rotates(Protocol):
    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


@runtime_checkable
class Biases(Protocol):
    def bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class QueryTerms(Protocol):
    def query_terms(
        self, q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor
    ) -> torch.Tensor: ...


@runtime_checkable
class ValueTerms(Protocol):
    def value_terms(self, probs: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class Gates(Protocol):
    def log_gates(self, x: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class Curves(Protocol):
    def query_curves(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class Selects(Protocol):
    def selection_scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class RemapRegion:
    """One region of a position remap (:class:`Remaps`): query i sees the keys at positions
    ``low[i] <= j < high[i]`` (the causal mask still applies), with the query rotated at ``q_at[i]``
    and the key at ``k_at[j]``. ``q_at``, ``low``, ``high``: (Tq,) integers; ``k_at``: (Tk,) integers >= 0.
    The regions of one call are disjoint."""

    q_at: torch.Tensor
    k_at: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor


@runtime_checkable
class Remaps(Protocol):
    def regions(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> list[RemapRegion]: ...

    def rotate_at(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class BiasTails:
    """Where a relative bias ``f_h(r)`` (r = j - i) is affine in r, one description per side.

    For ``r <= -past``:   ``f_h(r) = f_h(-past) + past_slope[h] * (r + past)``;
    for ``r >= future``:  ``f_h(r) = f_h(future) + future_slope[h] * (r - future)``.
    A slope of None means the tail is constant (slope 0). Slopes are fixed tensors (H,), never
    learned; the intercepts f_h(-past), f_h(future) may be learned (they come from ``relative_bias``).
    Example: causal ALiBi has past = 0 with slopes m_h; T5 with 32 buckets and max distance 128 has
    past = 113 (the first distance of the last bucket) and no slope.
    """

    past: int
    past_slope: torch.Tensor | None
    future: int
    future_slope: torch.Tensor | None


@runtime_checkable
class Scores(Protocol):
    def score(self, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class DistanceBias(Protocol):
    def relative_bias(self, relative: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class RelativeBias(Protocol):
    def relative_bias(self, relative: torch.Tensor) -> torch.Tensor: ...

    def bias_tails(self) -> BiasTails: ...


@dataclass(frozen=True)
class ClipTables:
    """What Shaw's ``query_terms`` and ``value_terms`` are made of (:class:`ClippedTables`).

    The pair (i, j) uses row ``clip(j - i, -clip, clip) + clip`` of both tables: its score term is
    ``q_i . key_table[row] * scale`` and its value term ``p_ij * value_table[row]``. Tables are
    (2 clip + 1, D) and may be learned.
    """

    clip: int
    key_table: torch.Tensor
    value_table: torch.Tensor
    scale: float


@dataclass(frozen=True)
class DistanceKeyForm:
    """What Transformer-XL's ``query_terms`` is made of (:class:`DistanceKeys`)::

        query_terms[i, j] = ((q_i + v) . position_keys(i - j)[h] + u . k_j) * scale

    ``u`` (H, D) is the global content bias, ``v`` (H, D) the global position bias (Dai et al. 2019,
    eq. in §3.3); both may be learned.
    """

    u: torch.Tensor
    v: torch.Tensor
    scale: float


@dataclass(frozen=True)
class ContextualForm:
    """What CoPE's ``query_terms`` are made of (:class:`ContextualPositions`)::

        g_it = sigmoid(q_i . k_t * gate_scale);  p_ij = min(sum_{t=j..i} g_it, P - 1)
        query_terms[i, j] = z_i[p_ij] interpolated,  z_i[p] = q_i . table[p] * logit_scale

    ``table`` (P, D) holds the position embeddings e[p] (learned).
    """

    table: torch.Tensor
    gate_scale: float
    logit_scale: float


@runtime_checkable
class ClippedTables(Protocol):
    def clipped_tables(self) -> ClipTables: ...


@runtime_checkable
class DistanceKeys(Protocol):
    def distance_key_form(self) -> DistanceKeyForm: ...

    def position_keys(self, distances: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...


@dataclass(frozen=True)
class DisentangledForm:
    """What DeBERTa's ``query_terms`` are made of (:class:`DisentangledTables`)::

        query_terms[i, j] = (q_i . query_table[t] + k_j . key_table[t]) * scale,  t = relative_rows(j - i)

    ``query_table`` (H, R, D) gives c2p (None without it), ``key_table`` (H, R, D) p2c (None
    without it); both are projections of the learned relative embeddings (He et al. 2020, eq. 4).
    """

    query_table: torch.Tensor | None
    key_table: torch.Tensor | None
    scale: float


@runtime_checkable
class DisentangledTables(Protocol):
    def disentangled_tables(self) -> DisentangledForm: ...

    def relative_rows(self, relative: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class BiasFeatures(Protocol):
    def bias_features(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@runtime_checkable
class ContextualPositions(Protocol):
    def contextual_positions(self) -> ContextualForm: ...


HOOKS: tuple[type, ...] = (Embeds, Rotates, Biases, QueryTerms, ValueTerms, Gates, Curves, Selects, Remaps)
CAPABILITIES: tuple[type, ...] = (
    Scores, DistanceBias, RelativeBias, ClippedTables, DistanceKeys, DisentangledTables, BiasFeatures, ContextualPositions,
)


@functools.cache  # a Protocol's members never change; offers() runs several times per layer and step
def members(capability: type) -> tuple[str, ...]:
    """The method names a hook or capability Protocol asks for."""
    return tuple(name for name, value in vars(capability).items() if not name.startswith("_") and callable(value))


def offers(encoding: object, capability: type[C]) -> TypeIs[C]:
    """True when ``encoding`` implements every method of ``capability`` (one of :data:`HOOKS` or
    :data:`CAPABILITIES`); a type checker then knows the encoding has them.

    A subclass can switch a hook off by setting it to None; every method must be callable.

    Raises:
        TypeError: ``capability`` is not one of the hook or capability Protocols (a programming
            error, not a user's).
    """
    kind: type = capability  # a class, hashable: the key of members' cache
    if kind not in HOOKS and kind not in CAPABILITIES:
        raise TypeError(f"capability must be one of {[c.__name__ for c in HOOKS + CAPABILITIES]}, got {capability!r}")
    return all(callable(getattr(encoding, name, None)) for name in members(kind))


def require(encoding: object, capability: type[C]) -> C:
    """``encoding``, as one that offers ``capability``: for a backend function that a caller chose
    because :func:`offers` said so (the check is repeated, so a wrong call fails loudly).

    Raises:
        TypeError: ``encoding`` does not offer ``capability`` (a backend's bug, not a user's).
    """
    if not offers(encoding, capability):
        raise TypeError(f"{type(encoding).__name__} does not offer {capability.__name__}")
    return encoding


__all__ = [
    "CAPABILITIES", "HOOKS", "BiasFeatures", "BiasTails", "Biases", "ClipTables", "ClippedTables", "ContextualForm", "ContextualPositions",
    "Curves",
    "DisentangledForm", "DisentangledTables", "DistanceBias", "DistanceKeyForm", "DistanceKeys",
    "Embeds", "Gates",
    "QueryTerms", "RelativeBias", "RemapRegion", "Remaps", "Rotates", "Scores", "Selects", "ValueTerms", "members", "offers", "require",
]
