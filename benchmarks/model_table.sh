#!/usr/bin/env bash
# Issue 4, model level: the study's LM (dim 256, depth 4, 8 heads, batch 1, vocab 256), train = a
# full training step (forward, loss, backward, AdamW), infer = forward; side by side with the same
# config built with x-transformers (default attention and attn_flash=True). 5 rounds, ratios to the
# NoPE of the same round (median and min-max), a control row (NoPE again) for the noise floor.
# The targets are at N=2048. Run on a quiet machine (see README.md).
# Extra arguments are passed on, e.g. `benchmarks/model_table.sh --lengths 2048`.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m posenc bench --level model --lengths 512 1024 2048 --mode both --compare x-transformers \
    --dim 256 --depth 4 --heads 8 --batch 1 --vocab 256 \
    --rounds 5 --repeats 3 --warmup 1 --threads 2 --dtype float32 --device cpu --backend auto \
    --out benchmarks/results/model "$@"
