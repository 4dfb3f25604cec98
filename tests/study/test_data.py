"""Byte-level corpora: the default stdlib corpus, files and folders, fixed splits, clear errors."""

from __future__ import annotations

import builtins
import hashlib
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import posenc
from posenc import cli
from posenc.errors import UsageError
from posenc.study import data, windows

ARGS = ["--preset", "smoke", "--methods", "alibi", "learned", "--steps", "4", "--checkpoint-every", "2",
        "--eval-lengths", "32", "64", "--valid-bytes", "512", "--threads", "1"]



def study(out: Path, *extra: str, quiet: bool = True) -> int:
    return cli.main(["study", *ARGS, "--out", str(out), *(["--quiet"] if quiet else []), *extra])



def make_folder(root: Path, n: int = 60, order: list[int] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in order or range(n):
        sub = root / f"pkg{i % 3}"
        sub.mkdir(exist_ok=True)
        (sub / f"mod{i}.py").write_text("".join(f"def f{i}_{k}(x):\n    return x + {k}\n" for k in range(20)))
    return root


def test_default_corpus_excludes_tests_and_third_party():
    root, files = data.stdlib_files()
    assert root == Path(sysconfig.get_paths()["stdlib"])
    assert len(files) > 100
    for f in files:
        parts = f.relative_to(root).parts
        assert f.suffix == ".py"
        assert not any(p in ("test", "tests", "idlelib", "site-packages", "dist-packages") or p.startswith("test_") for p in parts), f


def test_default_corpus_fingerprint_and_budget():
    corpus = data.load_corpus("default", valid_bytes=1000)
    fp = corpus.fingerprint
    assert fp["files"] == fp["train_files"] + fp["valid_files"] and fp["valid_files"] > 0
    assert fp["bytes"] >= corpus.train.numel() and len(fp["sha256"]) == 64
    assert corpus.valid.numel() == 1001 and corpus.valid_tokens == 1000  # inputs + one more target
    assert corpus.train.dtype == torch.uint8
    assert fp["valid_sha256"] == hashlib.sha256(bytes(corpus.valid.tolist())).hexdigest()
    # the same corpus twice: the same fingerprint (what makes two runs comparable)
    assert data.load_corpus("default", valid_bytes=1000).fingerprint == fp


def test_split_by_file_is_fixed_and_independent_of_place_and_order(tmp_path):
    a = make_folder(tmp_path / "a")
    b = make_folder(tmp_path / "elsewhere" / "b", order=list(reversed(range(60))))
    ca, cb = data.load_corpus(str(a), valid_bytes=10_000), data.load_corpus(str(b), valid_bytes=10_000)
    assert torch.equal(ca.train, cb.train) and torch.equal(ca.valid, cb.valid)
    assert ca.fingerprint["sha256"] == cb.fingerprint["sha256"]
    # validation files are exactly those the hash rule names
    names = [p.relative_to(a).as_posix() for p in data.folder_files(a)]
    valid = [n for n in names if data.split_of(n) == "valid"]
    assert ca.fingerprint["valid_files"] == len(valid) > 0
    expected = b"".join((a / n).read_bytes() for n in valid)[:10_001]
    assert bytes(ca.valid.tolist()) == expected
    # changing one training file changes the fingerprint but not the validation text
    train_name = next(n for n in names if data.split_of(n) == "train")
    (b / train_name).write_text("changed\n")
    cb2 = data.load_corpus(str(b), valid_bytes=10_000)
    assert cb2.fingerprint["sha256"] != ca.fingerprint["sha256"]
    assert torch.equal(cb2.valid, ca.valid)


def test_folder_skips_binary_and_hidden_files(tmp_path):
    root = make_folder(tmp_path / "c", n=12)
    (root / "blob.bin").write_bytes(bytes(range(256)))
    (root / ".hidden").mkdir()
    (root / ".hidden" / "x.py").write_text("hidden = True\n" * 50)
    corpus = data.load_corpus(str(root))
    assert corpus.fingerprint["binary_files_skipped"] == 1
    assert corpus.fingerprint["files"] == 12
    assert b"hidden = True" not in bytes(corpus.train.tolist()) + bytes(corpus.valid.tolist())


def test_single_file_split_at_a_line(tmp_path):
    f = tmp_path / "one.txt"
    text = "".join(f"line {i} é\n" for i in range(500))  # UTF-8, multi-byte characters
    f.write_text(text, encoding="utf-8")
    corpus = data.load_corpus(str(f), valid_bytes=100_000)
    train, valid = bytes(corpus.train.tolist()), bytes(corpus.valid.tolist())
    assert train + valid == text.encode("utf-8")
    assert train.endswith(b"\n") and valid.startswith(b"line ")
    assert 0.05 < len(valid) / len(text.encode()) < 0.15


def test_tiny_folder_still_gets_both_splits(tmp_path):
    root = tmp_path / "two"
    root.mkdir()
    for name in ("a.txt", "b.txt"):
        (root / name).write_text("".join(f"{name} line {i}\n" for i in range(20)))
    corpus = data.load_corpus(str(root))
    # Both files hash to train, and moving one whole file would make validation 50% of the bytes:
    # the joined text is cut at a line instead, keeping validation's share of the bytes.
    fp = corpus.fingerprint
    assert fp["train_files"] >= 1 and fp["valid_files"] >= 1
    assert fp["train_files"] + fp["valid_files"] == 3  # b.txt has lines on both sides of the cut
    joined = (root / "a.txt").read_bytes() + (root / "b.txt").read_bytes()
    train, valid = bytes(corpus.train.tolist()), bytes(corpus.valid.tolist())
    assert train + valid == joined and train.endswith(b"\n") and valid.startswith(b"b.txt line ")
    assert 0.05 <= len(valid) / len(joined) <= 0.15 and fp["split"].startswith("by bytes")


@pytest.mark.parametrize("kind", ["empty_dir", "binary_file", "binary_only_dir", "empty_file", "missing"])
def test_unusable_corpus_is_a_clear_error(tmp_path, kind):
    path = tmp_path / kind
    if kind == "empty_dir":
        path.mkdir()
    elif kind == "binary_file":
        path.write_bytes(b"\x00\x01\x02" * 100)
    elif kind == "binary_only_dir":
        path.mkdir()
        (path / "x.dat").write_bytes(b"\xff\xfe\x00" * 100)
    elif kind == "empty_file":
        path.write_bytes(b"")
    with pytest.raises(UsageError, match=r"^data "):
        data.load_corpus(str(path))


def test_hf_without_datasets_says_what_it_needs(monkeypatch):
    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("no datasets here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(ValueError, match="needs the `datasets` package.*network"):
        data.load_corpus("hf:wikitext:wikitext-103-raw-v1")
    with pytest.raises(ValueError, match="dataset name"):
        data.load_corpus("hf:")


def test_valid_bytes_must_be_positive():
    with pytest.raises(ValueError, match="valid_bytes"):
        data.load_corpus("default", valid_bytes=0)


def test_train_batch_is_a_pure_function_of_seed_and_step():
    stream = torch.randint(0, 256, (5000,), dtype=torch.uint8)
    x1, y1 = data.train_batch(stream, seed=3, step=7, batch_size=4, length=16)
    torch.manual_seed(123)  # global RNG state must not matter
    x2, y2 = data.train_batch(stream, seed=3, step=7, batch_size=4, length=16)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == y1.shape == (4, 16) and x1.dtype == torch.long
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the next bytes
    x3, _ = data.train_batch(stream, seed=3, step=8, batch_size=4, length=16)
    x4, _ = data.train_batch(stream, seed=4, step=7, batch_size=4, length=16)
    assert not torch.equal(x1, x3) and not torch.equal(x1, x4)
    # each row is a contiguous slice of the stream
    s = stream.long()
    for row in x1:
        starts = [i for i in range(len(s) - 16) if torch.equal(s[i : i + 16], row)]
        assert starts
    with pytest.raises(ValueError, match="train_length"):
        data.train_batch(stream[:10], seed=0, step=0, batch_size=1, length=16)


@settings(max_examples=200, deadline=None)
@given(total=st.integers(1, 300), length=st.integers(1, 64), frac=st.floats(0.01, 1.0))
def test_windows_score_every_target_once(total, length, frac):
    stride = max(1, int(length * frac))
    seen = [0] * total
    length_eff = min(length, total)
    for begin, first in windows(total, length_eff, stride):
        assert 0 <= begin and begin + length_eff <= total  # every window is full length
        assert 0 <= first < length_eff
        for t in range(begin + first, begin + length_eff):
            seen[t] += 1
    assert seen == [1] * total
    if stride == length_eff:  # non-overlapping except possibly the last window
        assert len(windows(total, length_eff, stride)) == -(-total // length_eff)



class FakeSplit:
    """Just enough of a datasets.Dataset: column names, features, column access."""

    def __init__(self, rows: list[str]) -> None:
        self.rows = rows
        self.column_names = ["text"]
        self.features = {"text": type("Value", (), {"dtype": "string"})()}

    def __getitem__(self, column: str) -> list[str]:
        assert column == "text"
        return self.rows


def test_hf_dataset_splits_are_used_as_given(monkeypatch):
    calls = []

    def load_dataset(name, config=None):
        calls.append((name, config))
        return {"train": FakeSplit(["alpha beta"] * 50), "validation": FakeSplit(["gamma delta"] * 20)}

    fake = type(sys)("datasets")
    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    corpus = data.load_corpus("hf:wikitext:wikitext-2-raw-v1", valid_bytes=100)
    assert calls == [("wikitext", "wikitext-2-raw-v1")]
    assert bytes(corpus.train.tolist()) == "\n".join(["alpha beta"] * 50).encode()
    assert bytes(corpus.valid.tolist()) == "\n".join(["gamma delta"] * 20).encode()[:101]
    assert corpus.fingerprint["source"] == "hf:wikitext:wikitext-2-raw-v1"

    def offline(name, config=None):
        raise ConnectionError("no network")

    fake.load_dataset = offline
    with pytest.raises(ValueError, match="could not load.*needs a network"):
        data.load_corpus("hf:wikitext")


def test_folder_split_keeps_the_validation_share_by_bytes(tmp_path, capsys):
    root = tmp_path / "books"
    root.mkdir()
    (root / "book.txt").write_text("".join(f"chapter line {i} of the long book\n" for i in range(1200)))
    (root / "note.txt").write_text("".join(f"a short note {i}\n" for i in range(180)))
    assert data.split_of("book.txt") == "valid" and data.split_of("note.txt") == "train"  # the old trap
    book, note = (root / "book.txt").read_bytes(), (root / "note.txt").read_bytes()
    joined = book + note
    at = len(joined) * 90 // 100
    cut = joined.index(b"\n", at) + 1  # validation starts at the first line start from 90%
    corpus = data.load_corpus(str(root), valid_bytes=512)
    assert bytes(corpus.train.tolist()) == joined[:cut]  # was: the 3 KB note alone
    assert bytes(corpus.valid.tolist()) == joined[cut : cut + 513]
    share = (len(joined) - cut) / len(joined)
    line = (f"corpus {root}: 2 files, {len(joined):,} bytes; train 1 file, {cut:,} bytes; validation 2 files, "
            f"{len(joined) - cut:,} bytes (512 scored); split by bytes: the files joined in path order, last 10% "
            f"from a line start (the by-file rule would give validation {100 * len(book) / len(joined):.1f}% of the bytes)")
    assert corpus.summary() == line and 0.09 < share < 0.11
    out = tmp_path / "run"
    assert study(out, "--data", str(root), "--methods", "alibi", quiet=False) == 0
    assert line in capsys.readouterr().err.splitlines()


def test_skipped_files_are_named_with_their_reason(tmp_path, capsys):
    root = tmp_path / "mixed"
    root.mkdir()
    for i in range(4):
        (root / f"u{i}.txt").write_text("".join(f"utf-8 text {i} é {k}\n" for k in range(300)))
    (root / "latin.txt").write_bytes("café crème\n".encode("latin-1") * 50)
    (root / "blob.bin").write_bytes(b"\x00\x01" * 100)
    corpus = data.load_corpus(str(root), valid_bytes=512)
    assert corpus.skipped == [
        {"file": "blob.bin", "reason": "binary (a NUL byte at offset 0)"},
        {"file": "latin.txt", "reason": "not UTF-8 (invalid byte 0xe9 at offset 3; latin-1 or another encoding?)"},
    ]
    assert corpus.fingerprint["files"] == 4
    assert study(tmp_path / "run", "--data", str(root), "--methods", "alibi") == 0  # --quiet: warnings still show
    err = capsys.readouterr().err.splitlines()
    assert err == ["data: skipped blob.bin: binary (a NUL byte at offset 0)",
                   "data: skipped latin.txt: not UTF-8 (invalid byte 0xe9 at offset 3; latin-1 or another encoding?)"]
    # one such file alone is refused, with the same reason
    with pytest.raises(posenc.UsageError) as e:
        data.load_corpus(str(root / "latin.txt"))
    assert str(e.value) == (f"data {root / 'latin.txt'}: {root / 'latin.txt'} is not UTF-8 text: not UTF-8 "
                            "(invalid byte 0xe9 at offset 3; latin-1 or another encoding?)")


def test_default_corpus_split_is_unchanged():
    """The committed default-study numbers come from this split: the by-file rule, unchanged."""
    fp = data.load_corpus("default", valid_bytes=1000).fingerprint
    assert fp["split"] == "by file: sha256(relative path) mod 100 < 10 -> validation"
    root, stdlib = data.stdlib_files()
    names = [p.relative_to(root).as_posix() for p in stdlib if p.stat().st_size]  # empty files add nothing
    valid = [n for n in names if data.split_of(n) == "valid"]
    assert fp["valid_files"] == len(valid) and fp["train_files"] == len(names) - len(valid)
