#!/usr/bin/env bash
# Set up posenc in ./.venv. `bash setup.sh` for the library and CLI, `bash setup.sh test` adds the
# test-only reference packages (transformers, x-transformers, rotary-embedding-torch, pytest).
# torch is pinned here, on the setup path, to the CPU build this machine carries; the library itself
# only asks for torch>=2.5.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
.venv/bin/python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
extra=""
[ "${1:-}" = "test" ] && extra="[test]"
.venv/bin/python -m pip install -q -e ".${extra}" 2>&1 | grep -v "is ignored" || true
.venv/bin/python -c "import torch, posenc; print(f'posenc {posenc.__version__} ready, torch {torch.__version__}')"
