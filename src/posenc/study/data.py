"""Byte-level corpora for ``posenc study``: the built-in default, any text file or folder, or a
Hugging Face dataset; split into train and validation by a fixed rule, with a fingerprint.

Tokens are the UTF-8 bytes of the text (vocabulary 256), so a loss in nats per token converts to
bits per byte by dividing by ln 2, and no tokenizer has to be downloaded or trained.

- ``default``: the ``.py`` source of the running Python's standard library, tests excluded. It is on
  every machine that can run posenc, needs no download, and is long-range structured text (indented
  blocks, matching names) where position information matters. Directories named ``test``, ``tests``,
  ``idlelib``, ``test_*``, ``__pycache__`` and any ``site-packages`` / ``dist-packages`` are skipped
  (on a pyenv install the stdlib path itself contains a site-packages folder).
- a path: one UTF-8 text file, or a folder whose UTF-8 text files (recursively, hidden entries and
  binary files skipped) are used.
- ``hf:NAME[:CONFIG]``: the ``train`` and ``validation`` splits of a Hugging Face dataset, when the
  ``datasets`` package is importable and the hub can be reached. Nothing else is ever downloaded.

Split rule (files): a file is validation when the first 8 hex digits of sha256(relative path) taken
mod 100 fall below ``VALID_PERCENT``: fixed, independent of file order, file system and seed. The
rule is kept only when it gives validation a share of the bytes near ``VALID_PERCENT`` (between half
and twice that); a folder where it cannot (one big file and a small one, or every file hashed to
one side) is joined in path order and cut at a line boundary so that validation is the last
``VALID_PERCENT`` percent of the bytes, as for a single file. Files that are not UTF-8 text are
skipped in a folder (each is listed with its reason: binary, or not UTF-8) and refused as a single
file. Only the first ``valid_bytes + 1`` bytes of validation text are kept, so every evaluation
length scores exactly the same ``valid_bytes`` target tokens.

:func:`tokenized` turns a byte corpus into a real checkpoint's token ids (``posenc extend`` of a
transformers model with its own tokenizer): the same split, each split's text encoded.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import UsageError

VALID_PERCENT = 10
DEFAULT_VALID_BYTES = 64 * 1024
SKIP_DIRS = {"test", "tests", "idlelib", "__pycache__", "site-packages", "dist-packages"}


@dataclass
class Corpus:
    """Train and validation byte streams (uint8 tensors) and the fingerprint of where they came from."""

    train: torch.Tensor  # (N_train,) uint8
    valid: torch.Tensor  # (valid_bytes + 1,) uint8: inputs and the targets they predict
    fingerprint: dict = field(default_factory=dict)
    # (F,) int64 offsets in ``train`` where each file (a document) starts; None: one document.
    train_documents: torch.Tensor | None = field(default=None, repr=False)

    @property
    def valid_tokens(self) -> int:
        """Number of scored validation targets (the same at every evaluation length)."""
        return max(0, self.valid.numel() - 1)

    @property
    def skipped(self) -> list[dict]:
        """Files left out of a folder: ``{"file": relative path, "reason": why}``."""
        return list(self.fingerprint.get("skipped", []))

    def summary(self) -> str:
        """One line: where the text came from, and how many files and bytes each split holds."""
        fp = self.fingerprint

        def files(n: int | None) -> str:
            return "" if n is None else f"{n:,} file{'s' if n != 1 else ''}, "

        line = f"corpus {fp.get('source')}: {files(fp.get('files') or None)}{fp.get('bytes', 0):,} bytes; "
        line += f"train {files(fp.get('train_files'))}{fp.get('train_bytes', self.train.numel()):,} bytes; "
        line += f"validation {files(fp.get('valid_files'))}{fp.get('valid_split_bytes', 0):,} bytes"
        line += f" ({self.valid_tokens:,} scored)"
        if fp.get("skipped"):
            line += f"; {len(fp['skipped'])} file(s) skipped"
        return line + f"; split {fp.get('split')}"


def split_of(relative_path: str) -> str:
    """'valid' or 'train' for a file, from a hash of its relative path (posix separators)."""
    h = int(hashlib.sha256(relative_path.encode("utf-8")).hexdigest()[:8], 16)
    return "valid" if h % 100 < VALID_PERCENT else "train"


def _skip_dir(name: str) -> bool:
    return name in SKIP_DIRS or name.startswith("test_") or name.startswith(".")


def stdlib_files() -> tuple[Path, list[Path]]:
    """The stdlib root and its ``.py`` files, tests and third-party packages excluded, sorted.

    Raises:
        UsageError: the standard library's source folder is not found (data ``default`` cannot be
            built; pass a path instead).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise UsageError(f"data 'default': the standard library source was not found at {root}; pass a path as data")
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not _skip_dir(x))
        for n in names:
            if n.endswith(".py") and not n.startswith("test_"):
                files.append(Path(d) / n)
    return root, sorted(files, key=lambda p: p.relative_to(root).as_posix())


def text_problem(data: bytes) -> str | None:
    """Why ``data`` is not usable as UTF-8 text (binary, or another encoding), or None."""
    nul = data.find(b"\x00")
    if nul >= 0:
        return f"binary (a NUL byte at offset {nul})"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"not UTF-8 (invalid byte 0x{data[err.start]:02x} at offset {err.start}; latin-1 or another encoding?)"
    return None


def folder_files(root: Path) -> list[Path]:
    files: list[Path] = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not x.startswith(".") and x != "__pycache__")
        files.extend(Path(d) / n for n in names if not n.startswith("."))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _tensor(data: bytes | bytearray) -> torch.Tensor:
    if not data:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()  # (N,)


def _finish(train: bytes, valid: bytes, valid_bytes: int, fingerprint: dict, what: str) -> Corpus:
    if len(train) < 2:
        raise UsageError(f"data {what}: the training split is empty")
    if len(valid) < 2:
        raise UsageError(f"data {what}: the validation split is empty (needs at least 2 bytes)")
    fingerprint.update(train_bytes=len(train), valid_split_bytes=len(valid))
    valid = valid[: valid_bytes + 1]
    fingerprint.update(valid_bytes_used=len(valid) - 1, valid_sha256=hashlib.sha256(valid).hexdigest())
    return Corpus(_tensor(train), _tensor(valid), fingerprint)


def _starts(texts: list[bytes], limit: int | None = None) -> list[int]:
    """Offsets where each text starts once the texts are joined (those below ``limit``)."""
    out, at = [], 0
    for t in texts:
        if limit is None or at < limit:
            out.append(at)
        at += len(t)
    return out


def _split(names: list[str], texts: list[bytes]) -> tuple[bytes, bytes, dict]:
    """(train, validation, how) for the texts of a set of files, by the rule of the module docstring;
    ``how["train_starts"]``: where each file starts in the train bytes."""
    total = sum(map(len, texts))
    side = [split_of(n) for n in names]
    valid_share = sum(len(t) for t, s in zip(texts, side) if s == "valid") / total
    if len(names) > 1 and VALID_PERCENT / 2 <= 100 * valid_share <= 2 * VALID_PERCENT:
        how = {
            "split": f"by file: sha256(relative path) mod 100 < {VALID_PERCENT} -> validation",
            "train_files": side.count("train"), "valid_files": side.count("valid"),
            "train_starts": _starts([t for t, s in zip(texts, side) if s == "train"]),
        }
        return (b"".join(t for t, s in zip(texts, side) if s == "train"),
                b"".join(t for t, s in zip(texts, side) if s == "valid"), how)
    joined = b"".join(texts)  # path order
    cut = _line_cut(joined, len(joined) * (100 - VALID_PERCENT) // 100)
    ends = [sum(map(len, texts[: i + 1])) for i in range(len(texts))]
    starts = [e - len(t) for e, t in zip(ends, texts)]
    if len(names) == 1:
        rule = f"single file: last {VALID_PERCENT}% of the bytes, from a line start"
    else:
        rule = (f"by bytes: the files joined in path order, last {VALID_PERCENT}% from a line start (the "
                f"by-file rule would give validation {100 * valid_share:.1f}% of the bytes)")
    how = {
        "split": rule,
        "train_files": sum(b < cut for b in starts),  # files with bytes on each side of the cut
        "valid_files": sum(e > cut for e in ends),
        "train_starts": _starts(texts, cut),
    }
    return joined[:cut], joined[cut:], how


def _from_files(root: Path, files: list[Path], source: str, valid_bytes: int, *, skip_bad: bool) -> Corpus:
    digest = hashlib.sha256()
    names: list[str] = []
    texts: list[bytes] = []
    skipped: list[dict] = []
    for path in files:
        rel = path.relative_to(root).as_posix() if path != root else path.name
        data = path.read_bytes()
        if not data:
            continue
        problem = text_problem(data)
        if problem:
            if not skip_bad:
                raise UsageError(f"data {source}: {path} is not UTF-8 text: {problem}")
            skipped.append({"file": rel, "reason": problem})
            continue
        if not data.endswith(b"\n"):
            data += b"\n"  # files are joined end to end; keep the boundary a line break
        digest.update(rel.encode("utf-8") + b"\x00" + data)
        names.append(rel)
        texts.append(data)
    if not names:
        kinds = sorted({s["reason"].split(" (")[0] for s in skipped})
        reason = f" ({len(skipped)} file(s) skipped: {', '.join(kinds)})" if skipped else ""
        raise UsageError(f"data {source}: no UTF-8 text found{reason}; the corpus is empty")
    fingerprint = {"source": source, "files": len(names), "bytes": sum(map(len, texts)), "sha256": digest.hexdigest()}
    if skipped:
        fingerprint["skipped"] = skipped
        fingerprint["binary_files_skipped"] = len(skipped)  # (all skipped files: binary or not UTF-8)
    train, valid, how = _split(names, texts)
    starts = how.pop("train_starts")
    fingerprint.update(how)
    corpus = _finish(train, valid, valid_bytes, fingerprint, source)
    corpus.train_documents = torch.tensor(starts, dtype=torch.long)  # (F,)
    return corpus


def _line_cut(text: bytes, at: int) -> int:
    nl = text.find(b"\n", at)
    return at if nl < 0 or nl + 1 >= len(text) else nl + 1


def _from_hf(spec: str, valid_bytes: int) -> Corpus:
    name, _, config = spec[len("hf:") :].partition(":")
    if not name:
        raise UsageError("data hf:NAME[:CONFIG] needs a dataset name, e.g. hf:wikitext:wikitext-103-raw-v1")
    try:
        import datasets  # noqa: F401  (optional: never installed by posenc)
    except ImportError:
        raise UsageError(
            f"data {spec} needs the `datasets` package (pip install datasets) and a network "
            "connection; use data 'default' or a path to run offline"
        ) from None
    try:
        ds = datasets.load_dataset(name, config or None)
    except Exception as err:  # network, unknown name, ...: one clear line
        raise UsageError(f"data {spec}: could not load the dataset ({type(err).__name__}: {err}); it needs a network") from None
    vsplit = "validation" if "validation" in ds else "test" if "test" in ds else None
    if "train" not in ds or vsplit is None:
        raise UsageError(f"data {spec}: the dataset needs a 'train' and a 'validation' (or 'test') split, has {list(ds)}")

    def text_of(split: Any) -> bytes:  # a datasets split (untyped)
        column = "text" if "text" in split.column_names else next(
            (c for c, f in split.features.items() if getattr(f, "dtype", None) == "string"), None
        )
        if column is None:
            raise UsageError(f"data {spec}: no text column in {split.column_names}")
        return "\n".join(split[column]).encode("utf-8")

    train, valid = text_of(ds["train"]), text_of(ds[vsplit])
    digest = hashlib.sha256(train)
    digest.update(valid)
    fingerprint = {
        "source": spec,
        "files": 0,
        "bytes": len(train) + len(valid),
        "sha256": digest.hexdigest(),
        "split": f"dataset splits: train / {vsplit}",
    }
    return _finish(train, valid, valid_bytes, fingerprint, spec)


TOKENIZE_PIECE = 1 << 20  # characters encoded per call: whole lines, about 1 MB of text


def _pieces(text: str, size: int = TOKENIZE_PIECE) -> list[str]:
    """``text`` in consecutive pieces of about ``size`` characters, each cut after a line end."""
    pieces, start = [], 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end < 0 else end + 1
        pieces.append(text[start:end])
        start = end
    return pieces


def tokenized(corpus: Corpus, tokenizer: Any, name: str) -> Corpus:
    """``corpus`` in a tokenizer's ids (int32): each split's bytes decoded as UTF-8 (a character cut
    at a split's edge becomes U+FFFD) and encoded without special tokens, in pieces of whole lines of
    about 1 MB (a tokenizer joins no token across a piece's line end). The validation split is the
    same ``valid_bytes + 1`` bytes, so it holds fewer tokens: :attr:`Corpus.valid_tokens` counts them.
    ``tokenizer``: a transformers tokenizer (called on a list of texts); ``name`` goes to the fingerprint.
    Files are not kept as documents (``train_documents`` is None)."""

    def ids(data: torch.Tensor) -> torch.Tensor:
        pieces = _pieces(bytes(data.numpy()).decode("utf-8", errors="replace"))
        if not pieces:
            return torch.zeros(0, dtype=torch.int32)
        encoded = tokenizer(pieces, add_special_tokens=False)["input_ids"]
        return torch.cat([torch.tensor(e, dtype=torch.int32) for e in encoded])

    train, valid = ids(corpus.train), ids(corpus.valid)
    if valid.numel() < 2:
        raise UsageError(f"valid_bytes: the validation text is {valid.numel()} token(s) in {name}'s tokenizer; needs at least 2")
    fingerprint = {**corpus.fingerprint, "tokens": name, "train_tokens": train.numel(), "valid_tokens": valid.numel() - 1}
    return Corpus(train, valid, fingerprint)


def load_corpus(spec: str = "default", valid_bytes: int = DEFAULT_VALID_BYTES) -> Corpus:
    """Load ``default``, a path, or ``hf:NAME[:CONFIG]`` as byte streams; UsageError when unusable.

    Raises:
        UsageError: ``spec`` is neither ``default``, an existing file or folder, nor ``hf:NAME``, or
            ``valid_bytes`` is not a positive integer.
    """
    if not isinstance(valid_bytes, int) or valid_bytes < 1:
        raise UsageError(f"valid_bytes must be a positive integer, got {valid_bytes!r}")
    if spec in ("default", "DEFAULT"):
        root, files = stdlib_files()
        corpus = _from_files(root, files, "default", valid_bytes, skip_bad=True)
        corpus.fingerprint.update(root=str(root), python=sys.version.split()[0])
        corpus.fingerprint["source"] = "default (Python standard library .py files, tests excluded)"
        return corpus
    if spec.startswith("hf:"):
        return _from_hf(spec, valid_bytes)
    path = Path(spec).expanduser()
    if path.is_file():
        return _from_files(path, [path], str(path), valid_bytes, skip_bad=False)
    if path.is_dir():
        return _from_files(path, folder_files(path), str(path), valid_bytes, skip_bad=True)
    raise UsageError(f"data must be 'default', an existing file or folder, or hf:NAME[:CONFIG]; {spec!r} does not exist")


def train_batch(
    stream: torch.Tensor, seed: int, step: int, batch_size: int, length: int, documents: torch.Tensor | None = None,
    ignore: int = -100,
) -> tuple[torch.Tensor, ...]:
    """Inputs and targets (B, T) int64 for one training step: a pure function of (seed, step).

    Random windows of ``length + 1`` bytes; drawing them from a generator seeded by (seed, step)
    makes the data order independent of process history, so a resumed run sees the same batches.
    With ``documents`` (the offsets where each file starts, :attr:`Corpus.train_documents`), also
    the inputs' document ids (B, T): a window that spans files is a packed row, and the target of a
    file's last byte (the next file's first byte) is ``ignore``.

    Raises:
        UsageError: ``length`` is not below the training split's size in bytes.
    """
    n = stream.numel() - length - 1
    if n < 1:
        raise UsageError(f"train_length ({length}) must be below the training split size ({stream.numel()} bytes)")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, n + 1, (batch_size,), generator=g)  # (B,)
    idx = starts[:, None] + torch.arange(length + 1)  # (B, T + 1)
    chunk = stream[idx].long()
    if documents is None:
        return chunk[:, :-1], chunk[:, 1:]
    docs = torch.searchsorted(documents, idx, right=True)  # (B, T + 1): the file each byte belongs to
    targets = chunk[:, 1:].masked_fill(docs[:, 1:] != docs[:, :-1], ignore)  # no target across files
    return chunk[:, :-1], targets, docs[:, :-1]
