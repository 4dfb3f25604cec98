#!/usr/bin/env bash
# Decode level (issue 13): one generated token per row after a KV cache of N tokens (the study's LM:
# dim 256, depth 4, 8 heads, vocab 256, random weights), batch 1 ("single") and 8 ("batched"),
# float32, 2 threads, every method as a ratio to the NoPE of its round, with Hugging Face's LLaMA
# (RoPE, SDPA) and BLOOM (ALiBi, eager) of the same sizes side by side. The targets: at 2,048 and
# 8,192 every method <= 1.15x NoPE, and posenc's RoPE and ALiBi >= 1.3x faster than LLaMA and BLOOM.
# The commands of the committed tables: benchmarks/results/decode (N = 2,048 and 8,192; 324 jobs,
# ~9 minutes on a quiet 2-core Xeon) and benchmarks/results/decode-512 (N = 512; ~3 minutes).
# Run on a quiet machine (see README.md). Extra arguments are passed on to both.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m posenc bench --level decode --lengths 2048 8192 --mode both --compare transformers \
    --rounds 3 --repeats 20 --warmup 3 --threads 2 --dtype float32 --device cpu --backend auto \
    --out benchmarks/results/decode "$@"
python -m posenc bench --level decode --lengths 512 --mode both --compare transformers \
    --rounds 3 --repeats 20 --warmup 3 --threads 2 --dtype float32 --device cpu --backend auto \
    --out benchmarks/results/decode-512 "$@"
