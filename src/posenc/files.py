"""Files posenc writes: atomically, only where it may, and one run at a time.

- Atomic writes: a temporary name in the same folder, then a rename. A reader (or a resumed run)
  sees either the old file or the new one, never half of one, whatever interrupts the writer
  (Ctrl-C, a kill, a full disk). A write the machine refuses (disk full, read-only, no permission)
  is a :class:`WriteError`: one sentence naming the file, and the previous version is kept.
- Output directories (:class:`RunDir`): a directory posenc creates for a run carries a marker file,
  and posenc writes into an existing non-empty directory only when it carries that marker, so a
  user's own files are never overwritten. While a run writes into it, the run holds an exclusive
  ``flock`` on a lock file that records its pid: a second run fails at once, and a lock left by a
  killed run (the kernel drops the ``flock`` with the process, the pid stays in the file) is
  recognized, reported and taken over. Without ``fcntl`` (Windows) there is no lock.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from pathlib import Path
from types import ModuleType
from typing import Callable

from .errors import UsageError
from .version import __version__

fcntl: ModuleType | None
try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

MARKER = ".posenc-run"
LOCK = ".posenc-lock"
# What a full disk, a read-only file system or missing permissions look like from a write.
_REFUSED = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG,
            errno.ENOENT, errno.ENOTDIR, errno.EISDIR}


class WriteError(UsageError):
    """The machine refused a write (disk full, read-only, permissions): reported as one sentence,
    since the user can act on it and a traceback would not help; the previous file is kept."""


def _refused(path: Path, err: OSError, existed: bool) -> WriteError:
    kept = "; the previous version is unchanged" if existed else ""
    return WriteError(f"cannot write {path}: {err.strerror or err}{kept}")


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Call ``write(tmp)`` to fill a temporary file beside ``path``, then rename it to ``path``."""
    path = Path(path)
    existed = path.exists()
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # some writers create 0600 files; results are meant to be shared
        os.replace(tmp, path)
    except OSError as err:
        if err.errno in _REFUSED:
            raise _refused(path, err, existed) from err
        raise
    finally:
        if tmp.exists():
            tmp.unlink()


def write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda p: p.write_bytes(data))


def write_text(path: Path, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def write_json(path: Path, obj) -> None:
    """Strict JSON (``allow_nan=False``): a NaN or an infinity is a ValueError here, never an
    ``NaN`` / ``Infinity`` token that other JSON readers refuse."""
    write_text(path, json.dumps(obj, indent=1, allow_nan=False) + "\n")


def check_writable(path: Path, what: str = "out") -> None:
    """UsageError now, before any work, if the file ``path`` could not be written later."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{what}: {path} is a directory; name a file")
    above = next(d for d in path.parents if d.exists())
    if not above.is_dir():
        raise UsageError(f"{what}: cannot write {path}: {above} is not a directory")
    probe = path.with_name(f".{path.name}.probe{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise UsageError(f"{what}: cannot write {path}: {err.strerror or err}") from None


def _lock_info(text: str) -> dict:
    try:
        info = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return info if isinstance(info, dict) else {}


def _holder(info: dict) -> str:
    return f"pid {info.get('pid', '?')} on {info.get('host', '?')}, started {info.get('started', '?')}"


class RunDir:
    """An output directory claimed by this process for one run (see the module docstring).

    Use :meth:`claim`, then :meth:`release` when the run ends (or :meth:`discard` when it never
    started: a directory it created is removed again).
    """

    def __init__(self, path: Path, kind: str) -> None:
        self.path, self.kind = path, kind
        self.created: list[Path] = []  # directories this claim made, deepest last
        self.notice: str | None = None  # a stale lock taken over, said once to the user
        self.marked = False  # this claim wrote the marker
        self._fd: int | None = None

    @classmethod
    def claim(cls, path: str | Path, kind: str, owned: Callable[[Path], bool] = lambda p: False) -> "RunDir":
        """Create or reuse ``path`` and lock it; UsageError when it is someone else's or in use.

        Args:
            kind: what runs there ("study"), for the messages.
            owned: recognizes a directory posenc made before markers existed (e.g. a results.json).
        """
        self = cls(Path(path), kind)
        p = self.path
        if p.exists() and not p.is_dir():
            raise UsageError(f"out directory {str(p)!r} is not writable: it exists and is not a directory")
        if p.is_dir():
            others = sorted(set(os.listdir(p)) - {MARKER, LOCK})
            if others and not (p / MARKER).exists() and not owned(p):
                shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
                raise UsageError(f"out: {p} is not empty ({shown}) and was not made by posenc (no {MARKER} "
                                 "file); choose a new or empty directory, posenc does not write over other files")
        try:
            missing = [d for d in (p, *p.parents) if not d.exists()]
            p.mkdir(parents=True, exist_ok=True)
            self.created = list(reversed(missing))
            self._lock()
            if not (p / MARKER).exists():
                self.marked = True
                write_json(p / MARKER, {"posenc": __version__, "kind": kind,
                                        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        except OSError as err:
            self.release()
            raise UsageError(f"out directory {str(p)!r} is not writable: {err.strerror or err}") from None
        except BaseException:
            self.release()
            raise
        return self

    def _lock(self) -> None:
        self._fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        if fcntl is None:
            return
        for attempt in range(20):  # a report checking the lock holds it for an instant
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(0.05)
        else:
            info = _lock_info(os.pread(self._fd, 4096, 0).decode("utf-8", "replace"))
            os.close(self._fd)
            self._fd = None
            raise UsageError(f"out: {self.path} is in use by another posenc {info.get('kind', self.kind)} "
                             f"({_holder(info)}); wait for it to end, or choose another out")
        previous = os.pread(self._fd, 4096, 0).decode("utf-8", "replace").strip()
        if previous:
            info = _lock_info(previous)
            self.notice = (f"out: {self.path} was left locked by a posenc {info.get('kind', 'run')} that did not "
                           f"finish ({_holder(info)}; killed?); taking it over")
        mine = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "kind": self.kind,
                           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, mine, 0)
        os.fsync(self._fd)

    def release(self) -> None:
        """Unlock (the lock file stays, empty: removing it would race with a run waiting on it)."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        except OSError:
            pass
        finally:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def discard(self) -> None:
        """Release, and undo the claim when it made the directory or its marker: the files it
        wrote are removed, then the directories it created if nothing else was put there."""
        self.release()
        if self.marked:
            for name in (LOCK, MARKER):
                (self.path / name).unlink(missing_ok=True)
        for d in reversed(self.created):
            try:
                d.rmdir()
            except OSError:
                break


def lock_holder(path: str | Path) -> dict | None:
    """Who holds the run lock of directory ``path`` now ({"pid", "host", "started", ...}), or None
    when no live process does (never started, finished, or killed)."""
    lock = Path(path) / LOCK
    if fcntl is None or not lock.is_file():
        return None
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _lock_info(os.pread(fd, 4096, 0).decode("utf-8", "replace")) or {"pid": "?"}
    finally:
        os.close(fd)
    return None
