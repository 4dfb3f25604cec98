"""Byte-level corpora for ``posenc study``: the built-in default, any text file or folder, or a
Hugging Face dataset; split into train and validation by a fixed rule, with a fingerprint.

Tokens are the UTF-8 bytes of the text (vocabulary 256), so a loss in nats per token converts to
bits per byte by dividing by ln 2, and no tokenizer has to be downloaded or trained.

- ``default``: the ``.py`` source of the running Python's standard library, tests excluded. It is on
  every machine that can run posenc, needs no download, and is long-range structured text (indented
  blocks, matching names) where position information matters. Directories named ``test``, ``tests``,
  ``idlelib``, ``test_*``, ``__pycache__`` and any ``site-packages`` / ``dist-packages`` are skipped
  (on an interpreter installed by pyenv, sysconfig's stdlib path contains site-packages, i.e.
  every installed third-party package).
- a path: one UTF-8 text file, or a folder whose UTF-8 text files (recursively, hidden entries and
  binary files skipped) are used.
- ``hf:NAME[:CONFIG]``: the ``train`` and ``validation`` splits of a Hugging Face dataset, when the
  ``datasets`` package is importable and the hub can be reached. Nothing else is ever downloaded.

Split rule (files): a file is validation when the first 8 hex digits of sha256(relative path) taken
mod 100 fall below ``VALID_PERCENT``: fixed, independent of file order, file system and seed. A
single file is split at a line boundary, validation being its last ``VALID_PERCENT`` percent.
Only the first ``valid_bytes + 1`` bytes of validation text are kept, so every evaluation length
scores exactly the same ``valid_bytes`` target tokens.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import torch

VALID_PERCENT = 10
DEFAULT_VALID_BYTES = 64 * 1024
SKIP_DIRS = {"test", "tests", "idlelib", "__pycache__", "site-packages", "dist-packages"}


@dataclass
class Corpus:
    """Train and validation byte streams (uint8 tensors) and the fingerprint of where they came from."""

    train: torch.Tensor  # (N_train,) uint8
    valid: torch.Tensor  # (valid_bytes + 1,) uint8: inputs and the targets they predict
    fingerprint: dict = field(default_factory=dict)

    @property
    def valid_tokens(self) -> int:
        """Number of scored validation targets (the same at every evaluation length)."""
        return max(0, self.valid.numel() - 1)


def split_of(relative_path: str) -> str:
    """'valid' or 'train' for a file, from a hash of its relative path (posix separators)."""
    h = int(hashlib.sha256(relative_path.encode("utf-8")).hexdigest()[:8], 16)
    return "valid" if h % 100 < VALID_PERCENT else "train"


def _skip_dir(name: str) -> bool:
    return name in SKIP_DIRS or name.startswith("test_") or name.startswith(".")


def stdlib_files() -> tuple[Path, list[Path]]:
    """The stdlib root and its ``.py`` files, tests and third-party packages excluded, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise ValueError(f"--data default: the standard library source was not found at {root}; pass --data PATH")
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not _skip_dir(x))
        for n in names:
            if n.endswith(".py") and not n.startswith("test_"):
                files.append(Path(d) / n)
    return root, sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _is_text(data: bytes) -> bool:
    if b"\x00" in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def folder_files(root: Path) -> list[Path]:
    files = []
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
        raise ValueError(f"--data {what}: the training split is empty")
    if len(valid) < 2:
        raise ValueError(f"--data {what}: the validation split is empty (needs at least 2 bytes)")
    valid = valid[: valid_bytes + 1]
    fingerprint.update(
        train_bytes=len(train),
        valid_bytes_used=len(valid) - 1,
        valid_sha256=hashlib.sha256(valid).hexdigest(),
    )
    return Corpus(_tensor(train), _tensor(valid), fingerprint)


def _from_files(root: Path, files: list[Path], source: str, valid_bytes: int, *, skip_binary: bool) -> Corpus:
    digest = hashlib.sha256()
    parts: dict[str, list[bytes]] = {"train": [], "valid": []}
    names: dict[str, list[str]] = {"train": [], "valid": []}
    total, skipped = 0, 0
    for path in files:
        rel = path.relative_to(root).as_posix() if path != root else path.name
        data = path.read_bytes()
        if not data:
            continue
        if not _is_text(data):
            if not skip_binary:
                raise ValueError(f"--data {source}: {path} is not UTF-8 text (binary data)")
            skipped += 1
            continue
        if not data.endswith(b"\n"):
            data += b"\n"  # files are joined end to end; keep the boundary a line break
        digest.update(rel.encode("utf-8") + b"\x00" + data)
        total += len(data)
        names[split_of(rel)].append(rel)
        parts[split_of(rel)].append(data)
    count = len(names["train"]) + len(names["valid"])
    if count == 0:
        reason = f" ({skipped} binary file(s) skipped)" if skipped else ""
        raise ValueError(f"--data {source}: no UTF-8 text found{reason}; the corpus is empty")
    fingerprint = {"source": source, "files": count, "bytes": total, "sha256": digest.hexdigest()}
    if skipped:
        fingerprint["binary_files_skipped"] = skipped
    if count == 1:  # one file: the last VALID_PERCENT percent, from a line start, is validation
        text = (parts["train"] or parts["valid"])[0]
        cut = _line_cut(text, len(text) * (100 - VALID_PERCENT) // 100)
        train, valid = text[:cut], text[cut:]
        fingerprint.update(split="single file: last %d%% of lines" % VALID_PERCENT, train_files=1, valid_files=1)
    else:
        if not parts["valid"] or not parts["train"]:
            # A tiny folder can hash entirely to one side: move the single file whose hash is
            # lowest (a fixed choice) to the empty side.
            full, empty = ("train", "valid") if parts["train"] else ("valid", "train")
            i = min(range(len(names[full])), key=lambda k: hashlib.sha256(names[full][k].encode()).hexdigest())
            names[empty].append(names[full].pop(i))
            parts[empty].append(parts[full].pop(i))
        train, valid = b"".join(parts["train"]), b"".join(parts["valid"])
        fingerprint.update(
            split=f"by file: sha256(relative path) mod 100 < {VALID_PERCENT} -> validation",
            train_files=len(names["train"]),
            valid_files=len(names["valid"]),
        )
    return _finish(train, valid, valid_bytes, fingerprint, source)


def _line_cut(text: bytes, at: int) -> int:
    nl = text.find(b"\n", at)
    return at if nl < 0 or nl + 1 >= len(text) else nl + 1


def _from_hf(spec: str, valid_bytes: int) -> Corpus:
    name, _, config = spec[len("hf:") :].partition(":")
    if not name:
        raise ValueError("--data hf:NAME[:CONFIG] needs a dataset name, e.g. hf:wikitext:wikitext-103-raw-v1")
    try:
        import datasets  # noqa: F401  (optional: never installed by posenc)
    except ImportError:
        raise ValueError(
            f"--data {spec} needs the `datasets` package (pip install datasets) and a network "
            "connection; use --data default or --data PATH to run offline"
        ) from None
    try:
        ds = datasets.load_dataset(name, config or None)
    except Exception as err:  # network, unknown name, ...: one clear line
        raise ValueError(f"--data {spec}: could not load the dataset ({type(err).__name__}: {err}); it needs a network") from None
    vsplit = "validation" if "validation" in ds else "test" if "test" in ds else None
    if "train" not in ds or vsplit is None:
        raise ValueError(f"--data {spec}: the dataset needs a 'train' and a 'validation' (or 'test') split, has {list(ds)}")

    def text_of(split) -> bytes:
        column = "text" if "text" in split.column_names else next(
            (c for c, f in split.features.items() if getattr(f, "dtype", None) == "string"), None
        )
        if column is None:
            raise ValueError(f"--data {spec}: no text column in {split.column_names}")
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


def load_corpus(spec: str = "default", valid_bytes: int = DEFAULT_VALID_BYTES) -> Corpus:
    """Load ``default``, a path, or ``hf:NAME[:CONFIG]`` as byte streams; ValueError when unusable."""
    if not isinstance(valid_bytes, int) or valid_bytes < 1:
        raise ValueError(f"valid_bytes must be a positive integer, got {valid_bytes!r}")
    if spec in ("default", "DEFAULT"):
        root, files = stdlib_files()
        corpus = _from_files(root, files, "default", valid_bytes, skip_binary=True)
        corpus.fingerprint.update(root=str(root), python=sys.version.split()[0])
        corpus.fingerprint["source"] = "default (Python standard library .py files, tests excluded)"
        return corpus
    if spec.startswith("hf:"):
        return _from_hf(spec, valid_bytes)
    path = Path(spec).expanduser()
    if path.is_file():
        return _from_files(path, [path], str(path), valid_bytes, skip_binary=False)
    if path.is_dir():
        return _from_files(path, folder_files(path), str(path), valid_bytes, skip_binary=True)
    raise ValueError(f"--data must be 'default', an existing file or folder, or hf:NAME[:CONFIG]; {spec!r} does not exist")


def train_batch(
    stream: torch.Tensor, seed: int, step: int, batch_size: int, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets (B, T) int64 for one training step: a pure function of (seed, step).

    Random windows of ``length + 1`` bytes; drawing them from a generator seeded by (seed, step)
    makes the data order independent of process history, so a resumed run sees the same batches.
    """
    n = stream.numel() - length - 1
    if n < 1:
        raise ValueError(f"train_length ({length}) must be below the training split size ({stream.numel()} bytes)")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, n + 1, (batch_size,), generator=g)  # (B,)
    idx = starts[:, None] + torch.arange(length + 1)  # (B, T + 1)
    chunk = stream[idx].long()
    return chunk[:, :-1], chunk[:, 1:]
