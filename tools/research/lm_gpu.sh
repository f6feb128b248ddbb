#!/usr/bin/env bash
# The language model's GPU run: the 25m GPT preset, dense against Ok-Topk at density 1%, P ranks on the
# GPUs at hand (ranks share a GPU when there are fewer GPUs than ranks: NCCL then runs one host
# per rank over loopback, so MPS is started first; see docs/research/gpu-measurements.md).
#
#   tools/research/lm_gpu.sh [OUT_DIR]            env: P=4 STEPS=1000 SIZE=25m SEEDS=0 DRY=1 (print only)
#
# One launch per algorithm (each must fit the 10-minute command limit of a borrowed machine;
# STEPS sets that), then tools.research.lm_results merges them into OUT_DIR/lm-gpu-SIZE.json.
# Needs: torch with CUDA, the project installed (pip install --no-deps --no-build-isolation -e .),
# cupy optional (the communicator is CuPy NCCL when it imports, torch NCCL otherwise).
set -u
OUT=${1:-bench/results}
P=${P:-4}
STEPS=${STEPS:-1000}
SIZE=${SIZE:-25m}
SEEDS=${SEEDS:-0}
PY=${PY:-python3}
mkdir -p "$OUT"
run() { echo "+ $*"; if [ -z "${DRY:-}" ]; then "$@"; fi; }

mps=0
ngpu=$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ -z "${DRY:-}" ] && [ "$ngpu" -lt 1 ]; then echo "no CUDA device" >&2; exit 2; fi
if [ "$ngpu" -lt "$P" ] && command -v nvidia-cuda-mps-control >/dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  run nvidia-cuda-mps-control -d && mps=1
fi
parts=()
for alg in dense oktopk; do
  j="$OUT/lm-gpu-$SIZE-d0.01-$alg.json"
  run $PY -m oktopk_triton.cli train --model gpt --size "$SIZE" --device cuda --world-size "$P" \
      --density 0.01 --algorithms "$alg" --seeds $SEEDS --steps "$STEPS" --no-plot --json "$j" \
      --timeout 560
  parts+=("$j")
done
if [ "$mps" = 1 ]; then echo quit | nvidia-cuda-mps-control; fi
run $PY -m tools.research.lm_results merge "$OUT/lm-gpu-$SIZE.json" "${parts[@]}"
