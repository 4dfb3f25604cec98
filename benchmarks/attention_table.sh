#!/usr/bin/env bash
# Attention level (issues 4, 8, 11): one attention core (q, k, v given; encoding hooks + backend),
# B=1, H=8, D=64, causal, float32, 2 threads; train = forward+backward, infer = forward
# (inference_mode). 5 rounds: every job runs once per round in a fresh process, each ratio is to the
# NoPE of its own round, the table gives the median ratio and its min-max, and a control row (NoPE
# again) shows the noise floor. The targets are the ratios to NoPE at N=4096. This is the command of
# the committed table (benchmarks/results/attention): 280 jobs, about 11 minutes on a quiet 2-core
# Xeon. Run it on a quiet machine (see README.md). Extra arguments are passed on, e.g.
# `benchmarks/attention_table.sh --lengths 512 1024 2048 4096 --out /tmp/attention`.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m posenc bench --level attention --lengths 1024 4096 --mode both \
    --rounds 5 --repeats 2 --warmup 1 --threads 2 --dtype float32 --device cpu --backend auto \
    --out benchmarks/results/attention "$@"
