"""Associative recall: does a model *use* far context? (``posenc study --task recall``)

Flat perplexity does not show that a model reads far tokens: a model biased to recent tokens keeps
it flat by ignoring them. This task needs one far token and nothing else. A sequence holds
key-value pairs scattered among filler, then a block of queries: each query repeats a key of the
sequence and the model must answer with its value, which is nowhere but in the pair. It is
multi-query associative recall (MQAR: Arora et al. 2023, "Zoology", §3) with filler between the
pairs, so the distance from a query back to its pair can be set, in the spirit of the synthetic
length-generalization tasks of Kazemnejad et al. 2023 ("The Impact of Positional Encoding on Length
Generalization in Transformers").

Tokens are bytes, as in the language-model task: keys, values and filler come from three disjoint
byte ranges. Each key has its own few values (key k: values ``VALUES[k * per_key : (k + 1) * per_key]``,
one drawn per sequence), so a value names the key it belongs to and the answer is found in one
attention hop: the query attends to the one value of its key's set in the context and copies it.
With values shared by all keys the model would first have to learn a previous-token head (the value
known only as "the token after k"), the two-hop induction circuit of MQAR proper; a model of the
study's size learns that circuit far more slowly than the one-hop lookup, slower than a CPU study's
step budget allows, and what this task is for, fetching a token from a chosen distance, is the
same in both. The value is still random per sequence (chance
is 1 in ``per_key``), so it can only come from the context. A sequence of ``length`` inputs (``length + 1`` tokens) is a body, then ``queries``
pairs ``k v`` (the query block). The body is cut into two-token slots (one filler byte first when
its length is odd): ``queries`` slots hold the queried pairs, ``distractors`` slots hold pairs with
other keys (never queried), the rest hold filler; every key of a sequence is different. The model
is scored only on the answers: the value after each query key.

- Training (:func:`train_batch`): the queried pairs in slots drawn uniformly from the whole body, so
  training covers every distance the training length holds.
- Evaluation (:func:`eval_set`): at each length, three distance classes; the queried pairs sit in a
  window of ``window`` slots: ``near`` the end of the body (just before the queries), ``middle`` its
  centre, ``far`` its start (the whole length away: past the training length once the evaluation
  length exceeds it). The distances realized are returned with the tokens, and reported.

Streams: training batches come from a generator seeded by ("recall-train", seed, step) and
evaluation sets from ("recall-eval", length, class), hashed: different streams, the evaluation sets
the same for every seed and run (so runs and seeds compare on the same sequences), and no
evaluation sequence equal to a training one (checked in the tests).

Shape legend: N sequences, T inputs (``length``), Q queries.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from ..errors import UsageError
from .train import IGNORE

FILLER = tuple(range(32, 64))  # 32 filler bytes (space .. '?')
KEYS = tuple(range(64, 96))  # up to 32 key bytes ('@' .. '_')
VALUES = tuple(range(128, 256))  # value bytes (above ASCII): key k owns VALUES[k * per_key : (k + 1) * per_key]
CLASSES = ("near", "middle", "far")


@dataclass(frozen=True)
class Recall:
    """The task's sizes (the same for training and evaluation)."""

    queries: int = 4
    distractors: int = 4
    keys: int = 16  # how many of KEYS are used
    per_key: int = 4  # values each key owns

    def values_of(self, keys: torch.Tensor, draw: torch.Tensor) -> torch.Tensor:
        """The value byte number ``draw`` (0 .. per_key - 1) of each key index in ``keys``."""
        return torch.tensor(VALUES)[keys * self.per_key + draw]

    def window(self, train_length: int) -> int:
        """Slots of an evaluation distance window: an eighth of the training length (in tokens), at
        least the queries it must hold."""
        return max(self.queries, train_length // 16)

    def check(self, length: int) -> None:
        """Check that a sequence of ``length`` inputs fits the task's queries and distractors.

        Raises:
            UsageError: a sequence of ``length`` inputs has too few pair slots for the task's queries
                and distractors (naming the least length that fits).
        """
        slots = (length + 1 - 2 * self.queries) // 2
        if slots < self.queries + self.distractors:
            raise UsageError(f"recall: a length of {length} holds {max(slots, 0)} pair slots besides its "
                             f"{self.queries} queries; it needs at least {self.queries + self.distractors} "
                             f"(use a longer train_length)")


TASK = Recall()


def _generator(*tag: object) -> torch.Generator:
    digest = hashlib.sha256(repr(tag).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def layout(length: int, spec: Recall = TASK) -> tuple[int, int, int]:
    """(pad, slots, body) of a sequence of ``length`` inputs: one filler byte when the body is odd,
    then ``slots`` two-token slots; the query block starts at ``body``."""
    body = length + 1 - 2 * spec.queries
    return body % 2, body // 2, body


def sequences(g: torch.Generator, count: int, length: int, windows: tuple[int, int] | None = None,
              spec: Recall = TASK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``count`` sequences of ``length + 1`` tokens.

    Args:
        g: the stream to draw from.
        windows: (first, end) slots the queried pairs are drawn from; None: the whole body.
    Returns:
        tokens (N, T + 1) int64, answer positions (N, Q) (input positions of the query keys, whose
        next token is the answer), distances (N, Q) (query key position minus its pair's key position).
    """
    spec.check(length)
    pad, slots, body = layout(length, spec)
    q, d = spec.queries, spec.distractors
    first, end = windows or (0, slots)
    keys = torch.tensor(KEYS[: spec.keys])
    filler = torch.tensor(FILLER)
    tokens = filler[torch.randint(0, len(filler), (count, length + 1), generator=g)]  # (N, T + 1)
    answers = body + 2 * torch.arange(q)  # (Q,) the query keys' positions
    distances = torch.empty(count, q, dtype=torch.long)
    for n in range(count):
        index = torch.randperm(len(keys), generator=g)[: q + d]  # distinct keys
        pair_keys = keys[index]
        pair_values = spec.values_of(index, torch.randint(0, spec.per_key, (q + d,), generator=g))
        queried = first + torch.randperm(end - first, generator=g)[:q]  # (Q,) slots
        free = torch.ones(slots, dtype=torch.bool)
        free[queried] = False
        others = torch.nonzero(free).flatten()
        chosen = torch.cat([queried, others[torch.randperm(len(others), generator=g)[:d]]])  # (Q + D,)
        at = pad + 2 * chosen
        tokens[n, at], tokens[n, at + 1] = pair_keys, pair_values
        order = torch.randperm(q, generator=g)  # queries in another order than the pairs
        tokens[n, answers], tokens[n, answers + 1] = pair_keys[order], pair_values[order]
        distances[n] = answers - at[order]
    return tokens, answers.expand(count, q).clone(), distances


def targets(tokens: torch.Tensor, answers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (N, T) and targets (N, T): the answers at the query keys, IGNORE elsewhere."""
    x = tokens[:, :-1]
    y = torch.full_like(x, IGNORE)
    rows = torch.arange(x.shape[0])[:, None]
    y[rows, answers] = tokens[rows, answers + 1]
    return x, y


def train_batch(seed: int, step: int, batch_size: int, length: int, spec: Recall = TASK
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets (B, T) of one training step: a pure function of (seed, step)."""
    tokens, answers, _ = sequences(_generator("recall-train", seed, step), batch_size, length, None, spec)
    return targets(tokens, answers)


def window(cls: str, length: int, train_length: int, spec: Recall = TASK) -> tuple[int, int]:
    """(first, end) slots of distance class ``cls`` at ``length``."""
    _, slots, _ = layout(length, spec)
    w = min(spec.window(train_length), slots)
    if cls == "near":
        return slots - w, slots
    if cls == "far":
        return 0, w
    mid = (slots - w) // 2
    return mid, mid + w


def eval_set(length: int, cls: str, count: int, train_length: int, spec: Recall = TASK
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fixed evaluation sequences of one length and distance class: (tokens, answers, distances)
    as :func:`sequences` returns them; independent of the training seed."""
    g = _generator("recall-eval", length, cls, spec)
    return sequences(g, count, length, window(cls, length, train_length, spec), spec)


def fingerprint(lengths: list[int], eval_sequences: int, spec: Recall = TASK) -> dict:
    """What a recall study's data is (``results["corpus"]``): the task's settings and the number of
    evaluation sequences per length, once every one of ``lengths`` (training and evaluation) fits
    the task.

    Raises:
        UsageError: a length holds too few pair slots (:meth:`Recall.check`).
    """
    from dataclasses import asdict

    for n in lengths:
        spec.check(n)
    return {"source": "generated: associative recall (posenc.study.recall)", "task": asdict(spec),
            "sha256": None, "eval_sequences": eval_sequences}


__all__ = ["CLASSES", "FILLER", "KEYS", "Recall", "TASK", "VALUES", "eval_set", "fingerprint", "layout", "sequences",
           "targets", "train_batch", "window"]
