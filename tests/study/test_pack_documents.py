"""posenc study --pack-documents: each file a document; windows that span files are packed rows."""

from __future__ import annotations

import pytest
import torch

from posenc.errors import UsageError
from posenc.study.data import load_corpus, train_batch
from posenc.study.plan import check


def folder(tmp_path):
    for name, text in (("a.txt", "alpha " * 40), ("b.txt", "beta " * 30), ("c.txt", "gamma " * 50)):
        (tmp_path / name).write_text(text + "\n")
    return tmp_path


def test_windows_carry_document_ids_and_no_target_across_files(tmp_path):
    corpus = load_corpus(str(folder(tmp_path)), valid_bytes=16)
    docs = corpus.train_documents
    assert docs is not None and docs[0] == 0 and torch.all(docs[1:] > docs[:-1])
    x, y, ids = train_batch(corpus.train, 0, 0, 16, 64, docs)
    x0, y0 = train_batch(corpus.train, 0, 0, 16, 64)
    assert torch.equal(x, x0)  # the same windows as without packing
    crossing = ids[:, 1:] != ids[:, :-1]
    assert crossing.any()  # some window spans two files
    assert torch.all(y[:, :-1][crossing] == -100)  # the last byte of a file predicts nothing
    assert torch.equal(y[y != -100], y0[y != -100])


def test_a_packed_study_trains(tmp_path, monkeypatch):
    from posenc import LM
    from posenc.study import StudyConfig, run_experiment

    seen = []
    forward = LM.forward

    def spy(self, tokens, *args, **kwargs):
        if self.training:
            seen.append(kwargs.get("document_ids"))
        return forward(self, tokens, *args, **kwargs)

    monkeypatch.setattr(LM, "forward", spy)

    (tmp_path / "data").mkdir()
    cfg = StudyConfig(methods=["alibi", "rope"], data=str(folder(tmp_path / "data")),
                      pack_documents=True, steps=3, batch_size=2, train_length=32, eval_lengths=[32], dim=16, depth=1,
                      num_heads=2, valid_bytes=64, checkpoint_every=100)
    results = run_experiment(cfg, tmp_path / "run", progress=False)
    assert set(results["methods"]) == {"alibi", "rope"}
    assert len(seen) == 6 and all(d is not None and d.shape == (2, 32) for d in seen)  # every training step packed


def test_pack_documents_refused_for_recall():
    from posenc.study import StudyConfig

    with pytest.raises(UsageError, match="pack_documents applies to the lm task"):
        check(StudyConfig(task="recall", pack_documents=True))
