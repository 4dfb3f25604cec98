"""Files written atomically: a temporary name in the same folder, then a rename.

A reader (or a resumed run) sees either the old file or the new one, never half of one, whatever
interrupts the writer (Ctrl-C, a kill, a full disk).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # some writers create 0600 files; results are meant to be shared
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))


def write_json(path: Path, obj) -> None:
    write_text(path, json.dumps(obj, indent=1) + "\n")
