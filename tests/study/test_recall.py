"""The associative-recall task of ``posenc study --task recall``: the generator puts the queried
pairs where it says, training and evaluation never share a sequence, and only the answers count."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from posenc.errors import UsageError
from posenc.study import recall
from posenc.study.distributed import Context
from posenc.study.evaluation import evaluate_recall
from posenc.study.train import IGNORE

TRAIN = 64
CTX = Context(torch.device("cpu"))


def _check_sequences(tokens, answers, distances, spec=recall.TASK):
    keys, filler = set(recall.KEYS[: spec.keys]), set(recall.FILLER)
    values = set(recall.VALUES[: spec.keys * spec.per_key])
    for seq, ans, dist in zip(tokens.tolist(), answers.tolist(), distances.tolist()):
        body = ans[0]
        pad, slots, body_len = recall.layout(len(seq) - 1, spec)
        assert body == body_len and ans == [body + 2 * i for i in range(spec.queries)]
        pair_keys = [seq[pad + 2 * s] for s in range(slots) if seq[pad + 2 * s] in keys]
        assert len(pair_keys) == len(set(pair_keys)) == spec.queries + spec.distractors  # every key once
        for s in range(slots):  # a slot is a pair (key, value) or two filler bytes
            a, b = seq[pad + 2 * s], seq[pad + 2 * s + 1]
            assert (a in keys and b in values) or (a in filler and b in filler)
            if a in keys:  # the value is one of its key's own
                assert (recall.VALUES.index(b)) // spec.per_key == recall.KEYS.index(a)
        for a, d in zip(ans, dist):
            k = a - d  # where the generator says the queried pair is
            assert seq[k] == seq[a] and seq[k] in keys  # the query repeats that key
            assert seq[k + 1] == seq[a + 1] and seq[k + 1] in values  # and the answer is its value
            assert seq[:body].count(seq[a]) == 1  # nowhere else in the body


@pytest.mark.parametrize("length", [TRAIN, 4 * TRAIN])
def test_queried_pairs_sit_at_the_distances_the_generator_claims(length):
    far_min = None
    for cls in recall.CLASSES:
        tokens, answers, distances = recall.eval_set(length, cls, 16, TRAIN)
        assert tokens.shape == (16, length + 1) and tokens.dtype == torch.long
        _check_sequences(tokens, answers, distances)
        first, end = recall.window(cls, length, TRAIN)
        pad, _, _ = recall.layout(length)
        keys_at = answers - distances  # (N, Q) key positions: inside the class's window of slots
        assert ((keys_at - pad) // 2 >= first).all() and ((keys_at - pad) // 2 < end).all()
        if cls == "near":
            assert distances.max() <= 2 * (end - first) + 2 * recall.TASK.queries
        if cls == "far":
            far_min = int(distances.min())
    assert far_min is not None and (far_min > TRAIN if length > TRAIN else far_min > 0)  # beyond training


def test_training_batches_spread_pairs_over_the_whole_body_and_score_only_answers():
    x, y = recall.train_batch(0, 3, 32, TRAIN)
    assert x.shape == y.shape == (32, TRAIN)
    tokens = torch.cat([x, y[:, -1:]], dim=1)  # the last target is the last token
    scored = y != IGNORE
    assert scored.sum(dim=1).tolist() == [recall.TASK.queries] * 32
    _, _, body = recall.layout(TRAIN)
    assert scored[:, :body].sum() == 0  # nothing before the queries is scored
    g = torch.Generator().manual_seed(0)
    tokens, answers, distances = recall.sequences(g, 200, TRAIN)
    _check_sequences(tokens, answers, distances)
    assert distances.min() <= 6 and distances.max() >= TRAIN - 8  # near and far within the training length
    assert torch.equal(recall.train_batch(0, 3, 32, TRAIN)[0], x)  # a pure function of (seed, step)
    assert not torch.equal(recall.train_batch(1, 3, 32, TRAIN)[0], x)


def test_no_evaluation_sequence_is_a_training_sequence():
    """Different streams (evaluation sets do not depend on the seed), and no identical sequence
    between the evaluation sets at the training length and many training batches."""
    evals = torch.cat([recall.eval_set(TRAIN, cls, 64, TRAIN)[0][:, :-1] for cls in recall.CLASSES])
    assert torch.equal(evals[:64], recall.eval_set(TRAIN, "near", 64, TRAIN)[0][:, :-1])  # fixed
    seen = {tuple(row) for seed in (0, 1) for step in range(200) for row in recall.train_batch(seed, step, 32, TRAIN)[0].tolist()}
    assert len(seen) == 2 * 200 * 32  # (no repeats even within training)
    assert not any(tuple(row) in seen for row in evals.tolist())
    assert len({tuple(r) for r in evals.tolist()}) == len(evals)


def test_lengths_too_short_for_the_task_are_usage_errors():
    with pytest.raises(UsageError, match="recall: a length of 8 holds"):
        recall.eval_set(8, "far", 2, TRAIN)


class Oracle(nn.Module):
    """Logits that put the value of each key's earlier pair at every position holding a key seen
    before (``right_at_answers``), or a wrong value there and the right next token elsewhere."""

    def __init__(self, right_at_answers: bool) -> None:
        super().__init__()
        self.right = right_at_answers
        self.config = type("C", (), {"num_heads": 1})()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        logits = torch.zeros(b, t, 256)
        keys, values = set(recall.KEYS), recall.VALUES
        for n in range(b):
            seen = {}
            for i in range(t):
                tok = int(ids[n, i])
                if tok in keys and tok in seen:  # a query: its answer is the earlier pair's value
                    answer = seen[tok]
                    other = answer + 1 if (values.index(answer) + 1) % recall.TASK.per_key else answer - 1  # same key
                    logits[n, i, answer if self.right else other] = 1.0
                else:
                    if tok in keys and i + 1 < t:
                        seen[tok] = int(ids[n, i + 1])
                    if i + 1 < t:  # elsewhere: the true next token when the answers are wrong
                        logits[n, i, 0 if self.right else int(ids[n, i + 1])] = 1.0
        return logits


def test_accuracy_counts_only_the_answer_tokens():
    right = evaluate_recall(Oracle(True), TRAIN, TRAIN, 8, CTX)
    wrong = evaluate_recall(Oracle(False), TRAIN, TRAIN, 8, CTX)
    for cls in recall.CLASSES:
        assert right[cls]["accuracy"] == 1.0 and right[cls]["queries"] == 8 * recall.TASK.queries
        assert wrong[cls]["accuracy"] == 0.0  # right everywhere but at the answers: 0
        assert right[cls]["windows"]["correct"] == [recall.TASK.queries] * 8
        assert right[cls]["distance_min"] >= 2
