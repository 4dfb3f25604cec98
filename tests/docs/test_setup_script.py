"""setup.sh fails loudly: a failed pip step stops it with pip's exit status, before "ready".

Run against a stand-in Python whose venv's pip fails the way an impossible torch pin does
(ResolutionImpossible, exit 1); the real installs are what CI's own run of setup.sh checks.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FAKE_PYTHON = """#!/usr/bin/env bash
# A stand-in interpreter: `-m venv DIR` makes DIR/bin/python (this script); pip fails on torch.
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; exit 0; fi
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  case "$*" in
    *torch==*) echo "WARNING: Location 'file:///x' is ignored: it is neither a file nor a directory." >&2
               echo "ERROR: ResolutionImpossible: torch==$FAKE_TORCH" >&2; exit 1 ;;
    *) exit 0 ;;
  esac
fi
echo "posenc 0.0 ready, torch fake"
"""


def run_setup(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    work = tmp_path / "repo"
    work.mkdir()
    shutil.copy(ROOT / "setup.sh", work / "setup.sh")
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PYTHON=str(fake), FAKE_TORCH="2.99.0", POSENC_TORCH="torch==2.99.0")
    return subprocess.run(["bash", str(work / "setup.sh"), *args], capture_output=True, text=True, env=env, timeout=60)


def test_a_failed_torch_install_stops_setup(tmp_path):
    proc = run_setup(tmp_path)
    assert proc.returncode == 1
    assert "ResolutionImpossible: torch==2.99.0" in proc.stderr + proc.stdout
    assert "ready" not in proc.stdout  # never "ready" after a failed step
    assert "is ignored" not in proc.stderr + proc.stdout  # the one harmless warning is filtered


def test_unknown_argument_is_refused(tmp_path):
    proc = run_setup(tmp_path, "tests")
    assert proc.returncode == 2 and "usage: bash setup.sh [test]" in proc.stderr
