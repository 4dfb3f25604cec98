#!/usr/bin/env bash
# Model level (issues 4, 8, 11): a training step and a forward of the study's LM (dim 256, depth 4,
# 8 heads, batch 1, vocab 256) at N=2,048, float32, 2 threads, every method as a ratio to the NoPE of
# its round, the training step with x-transformers side by side (its default attention and its
# flash attention). The commands of the committed tables: benchmarks/results/model (train; about
# 200 jobs, ~33 minutes on a quiet 2-core Xeon, of which the committed table keeps 3 complete rounds:
# see its command.txt) and benchmarks/results/model-infer (inference; 42 jobs, ~3 minutes).
# Run on a quiet machine (see README.md). Extra arguments are passed on to both.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m posenc bench --level model --lengths 2048 --mode train --compare x-transformers \
    --dim 256 --depth 4 --heads 8 --batch 1 --vocab 256 \
    --rounds 5 --repeats 2 --warmup 1 --threads 2 --dtype float32 --device cpu --backend auto \
    --out benchmarks/results/model "$@"
python -m posenc bench --level model --lengths 2048 --mode infer \
    --dim 256 --depth 4 --heads 8 --batch 1 --vocab 256 \
    --rounds 3 --repeats 3 --warmup 1 --threads 2 --dtype float32 --device cpu --backend auto \
    --out benchmarks/results/model-infer "$@"
