"""Where a run's files go: the folder checked before any work, measurements saved as they come.

- :func:`check_out` creates the output folder and writes a probe file in it before any job runs,
  so an unwritable folder is a one-line :class:`~posenc.errors.UsageError` at once, not an error
  after all the measurements.
- :class:`Journal` rewrites ``jobs.json`` (atomically) after every job: an interrupted run keeps
  what it measured.
- :func:`write_outputs` writes every file atomically; :func:`save_fallback` puts the measurements
  in the temporary folder when the output folder fails at the end anyway.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from ..errors import UsageError
from ..files import RunDir, write_json, write_text
from .harness import Results
from .plan import Config
from .plots import plot
from .tables import csv_text, json_object, markdown_table

JOURNAL = "jobs.json"  # every job's record so far; removed once the outputs are written
OUTPUTS = ("table.md", "results.csv", "results.json", "command.txt", "plot.png")


def check_out(out: Path) -> Path:
    """Create ``out`` (a folder) and check that files can be written in it; UsageError otherwise."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"out must be a folder; {str(out)!r} is a file")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".posenc-bench-probe{os.getpid()}"
        write_text(probe, "")  # the same atomic path the outputs take: temporary file, fsync, rename
        probe.unlink()
    except OSError as err:
        raise UsageError(f"out: cannot write in {str(out)!r}: {err.strerror or err}") from None
    return out


def claim_out(out: Path) -> RunDir:
    """Check ``out`` and claim it for this run: a folder another program (or another posenc run)
    owns is refused (posenc never writes over other files; see :class:`posenc.files.RunDir`). A
    folder of bench results written before run markers existed is recognised as posenc's."""
    out = check_out(out)
    return RunDir.claim(out, "bench", owned=lambda p: (p / "command.txt").is_file() and (p / "results.json").is_file())


class Journal:
    """Saves every job's record as it comes, in ``path`` (rewritten atomically after each job).

    A failed write is reported once on stderr and the run goes on: the measurements stay in memory
    and :func:`save_fallback` can still keep them at the end.
    """

    def __init__(self, path: Path, header: dict | None = None) -> None:
        self.path, self.header = Path(path), dict(header or {})
        self.error: OSError | None = None

    def __call__(self, jobs: list[dict]) -> None:
        if self.error is not None:
            return
        try:
            write_json(self.path, {**self.header, "jobs": jobs})
        except OSError as err:
            self.error = err
            print(f"posenc bench: warning: cannot save measurements in {self.path} ({err}); going on", file=sys.stderr)


def journal_header(config: Config, command: str) -> dict:
    """What a journal records besides its jobs: the command, and the options a resume must match."""
    return {"command": command, "options": json.loads(json.dumps(config.to_dict()))}


def journal_jobs(path: Path, config: Config) -> list[dict]:
    """The finished jobs of the interrupted run whose journal is ``path``, for ``--resume``:
    UsageError when it is not a journal, or was measured with other options than ``config``'s."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise UsageError(f"resume: {path} cannot be read as a bench journal ({err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("jobs"), list) or not isinstance(data.get("options"), dict) \
            or not all(isinstance(j, dict) and {"round", "level", "mode", "length", "method", "impl"} <= set(j) for j in data["jobs"]):
        raise UsageError(f"resume: {path} is not a bench journal with its options (written by an older posenc, or "
                         "edited); move it away and run without --resume")
    want = journal_header(config, "")["options"]
    diff = [f"{k}: {data['options'].get(k)!r} -> {want.get(k)!r}" for k in sorted(set(want) | set(data["options"]))
            if data["options"].get(k) != want.get(k)]
    if diff:
        raise UsageError(f"resume: {path} was measured with other options ({'; '.join(diff)}); resume with its command: "
                         f"{data.get('command', '?')} --resume")
    return data["jobs"]


def clear_outputs(out: Path) -> list[str]:
    """Remove an earlier run's outputs from ``out`` (a fresh run replaces them); returns their names."""
    removed = []
    for name in OUTPUTS:
        if (Path(out) / name).is_file():
            (Path(out) / name).unlink()
            removed.append(name)
    return removed


def write_outputs(results: Results, out: Path) -> dict[str, Path]:
    """table.md, results.csv, results.json, command.txt and plot.png under ``out``, each atomically."""
    out = Path(out)
    paths = {name: out / name for name in OUTPUTS}
    write_text(paths["results.json"], _json(results))  # the measurements first
    write_text(paths["results.csv"], csv_text(results))
    write_text(paths["table.md"], markdown_table(results) + "\n")
    write_text(paths["command.txt"], results.meta.get("command", "") + "\n")
    plot(results.cells, paths["plot.png"], results.meta.get("title", ""))
    journal = out / JOURNAL
    if journal.exists():  # results.json holds every record it had
        journal.unlink()
    return paths


def _json(results: Results) -> str:
    return json.dumps(json_object(results), indent=1, allow_nan=False) + "\n"


def save_fallback(results: Results) -> Path:
    """Write every measurement to a new file in the temporary folder; returns its path."""
    path = Path(tempfile.gettempdir()) / f"posenc-bench-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json"
    write_text(path, _json(results))
    return path
