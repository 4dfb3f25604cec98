#!/usr/bin/env bash
# Issue 13, decode level: one generated token per row after a KV cache of N = 512, 2,048 and 8,192
# tokens (the study's LM: dim 256, depth 4, 8 heads, vocab 256, random weights), batch 1 ("single")
# and 8 ("batched"), float32, 2 threads, every method as a ratio to the NoPE of its round, with Hugging
# Face's LLaMA (RoPE, SDPA) and BLOOM (ALiBi, eager) of the same sizes side by side. The targets: at
# 2,048 and 8,192 every method <= 1.15x NoPE, and posenc's RoPE and ALiBi >= 1.3x faster than LLaMA
# and BLOOM. Run on a quiet machine (see README.md). Extra arguments are passed on.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m posenc bench --level decode --lengths 512 2048 8192 --mode both --compare transformers \
    --rounds 5 --repeats 20 --warmup 3 --threads 2 --dtype float32 --device cpu --backend auto \
    --out benchmarks/results/decode "$@"
