#!/usr/bin/env bash
# Everything posenc can only check on a GPU, in one run of under 8 minutes on one CUDA GPU:
#   1. the tests marked `cuda` (tests/backends/test_cuda.py: flex training on CUDA with T5's table gradient,
#      bfloat16 and float16, decoding on CUDA), which skip on a machine without a GPU;
#   2. a one-GPU torchrun smoke study with the nccl backend;
#   3. the attention level in bfloat16 at N = 4,096 .. 16,384 (train and inference), ratios to NoPE;
#   4. the decode level in bfloat16 at caches of N = 4,096 .. 16,384 (batch 1 and 8), ratios to NoPE;
#   5. the position remaps (SelfExtend, ReRoPE, STRING, DCA) against plain RoPE, one attention forward
#      at 16,384 tokens in bfloat16 with SmolLM2's heads (benchmarks/remap_costs.py).
# Each part has its own time limit (a part that runs out is reported, the others still run); the
# benchmarks keep what they measured in their jobs.json when stopped. Results go under
# benchmarks/results/gpu/ (attention/, decode/, study-smoke-STAMP/, tests.log). The exit status is
# non-zero if any part failed. Tune with environment variables, e.g.
#   LENGTHS="4096 8192 16384" ATTENTION_METHODS="alibi t5 rope" benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
OUT=${OUT:-benchmarks/results/gpu}
LENGTHS=${LENGTHS:-4096 16384}
ATTENTION_METHODS=${ATTENTION_METHODS:-alibi t5}
DECODE_METHODS=${DECODE_METHODS:-rope alibi t5}
STAMP=$(date +%Y%m%d-%H%M%S)
mkdir -p "$OUT"
FAILED=()
START=$SECONDS

# part NAME SECONDS COMMAND...: run COMMAND under a time limit, print what runs and how long it took.
part() {
    local name=$1 limit=$2
    shift 2
    echo
    echo "=== [$name] (limit ${limit}s): $*"
    local t0=$SECONDS status=0
    timeout --kill-after=10 "$limit" "$@" || status=$?
    local took=$((SECONDS - t0))
    if [ "$status" -eq 0 ]; then
        echo "=== [$name] ok in ${took}s"
    else
        [ "$status" -eq 124 ] && echo "=== [$name] TIMED OUT after ${took}s" || echo "=== [$name] FAILED (exit $status) after ${took}s"
        FAILED+=("$name")
    fi
}

echo "posenc GPU check, $STAMP"
$PYTHON - <<'EOF'
import torch, posenc
assert torch.cuda.is_available(), "no CUDA GPU: this script needs one"
print(f"posenc {posenc.__version__}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"{torch.cuda.get_device_name()} x {torch.cuda.device_count()}")
EOF

# 1. The CUDA tests (they compile flex kernels: the first ones take a while).
part "cuda tests" 150 bash -c "set -o pipefail; $PYTHON -m pytest -m cuda -rs -W ignore tests/backends/test_cuda.py 2>&1 | tee '$OUT/tests.log'"

# 2. torchrun on one GPU, nccl: the smoke study end to end (train, evaluate, checkpoints).
if command -v torchrun >/dev/null; then TORCHRUN=(torchrun); else TORCHRUN=("$PYTHON" -m torch.distributed.run); fi
part "torchrun smoke study (nccl)" 100 "${TORCHRUN[@]}" --standalone --nproc_per_node=1 -m posenc study --preset smoke \
    --device cuda --quiet --out "$OUT/study-smoke-$STAMP"

# 3. Attention level, bfloat16, train and inference, against NoPE (flex for the bias methods).
# shellcheck disable=SC2086  # the method and length lists are meant to split into words
part "attention bench (bf16)" 120 $PYTHON -m posenc bench --level attention --device cuda --dtype bfloat16 \
    --methods $ATTENTION_METHODS --lengths $LENGTHS --mode both --rounds 1 --repeats 5 --warmup 2 --timeout 60 \
    --out "$OUT/attention"

# 4. Decode level, bfloat16, one token after a cache of N, batch 1 and 8, against NoPE.
# shellcheck disable=SC2086
part "decode bench (bf16)" 90 $PYTHON -m posenc bench --level decode --device cuda --dtype bfloat16 \
    --methods $DECODE_METHODS --lengths $LENGTHS --rounds 1 --repeats 20 --warmup 3 --timeout 40 \
    --out "$OUT/decode"

echo
echo "posenc GPU check: $((SECONDS - START))s in all; results under $OUT"
if [ ${#FAILED[@]} -gt 0 ]; then
    echo "failed: ${FAILED[*]}"
    exit 1
fi
echo "every part passed"
