#!/usr/bin/env bash
# The CPU language-model campaign: 4 gloo ranks, the 1m GPT, 1200 steps, every algorithm at
# density 1% and 0.1%, seeds 0-2, dense once (it does not depend on the density). Sequential, in
# priority order (dense, Ok-Topk 1%, PowerSGD, bf16, gTop-k 1%, Ok-Topk 0.1%, the rest), one launch per group so a failure or a cut-off only
# costs that group; merge the parts with python -m tools.research.lm_results merge.
#   nohup nice -n 15 tools/research/lm_campaign.sh OUT_DIR [python] [extra train args] > OUT_DIR/campaign.log 2>&1 &
# The default --reduce auto makes the sparse algorithms reduce AdamW's updates
# (SparseAllreduce.reduce_updates); pass "--reduce gradients" to rerun the stalled setup.
set -u
OUT=${1:?usage: tools/research/lm_campaign.sh OUT_DIR [python] [extra args]}
PY=${2:-python3}
shift $(( $# < 2 ? $# : 2 ))
EXTRA=("$@")
mkdir -p "$OUT"
run() {  # tag, density, algorithms..., --seeds ...
  local tag=$1 d=$2; shift 2
  echo "=== $(date +%T) $tag d=$d $*"
  "$PY" -m oktopk_triton.cli train --model gpt --density "$d" --no-plot \
      --json "$OUT/$tag.json" ${EXTRA[@]+"${EXTRA[@]}"} --algorithms "$@" \
      || echo "!!! $tag exited with $?"
}
# 1200 steps, evaluated every 60, unless the extra args override them (argparse: last wins)
BASE=(--steps 1200 --eval-every 60)
run p0-dense 0.01 dense --seeds 0 1 2 "${BASE[@]}"
run p1-d0.01-oktopk 0.01 oktopk --seeds 0 1 2 "${BASE[@]}"
# the baselines a user would pick (a group fails alone, with its error, where train lacks them)
run p2-powersgd 0.01 powersgd --seeds 0 1 2 "${BASE[@]}"
run p3-bf16 0.01 bf16 --seeds 0 1 2 "${BASE[@]}"
run p4-d0.01-gtopk 0.01 gtopk --seeds 0 1 2 "${BASE[@]}"
run p5-d0.001-oktopk 0.001 oktopk --seeds 0 1 2 "${BASE[@]}"
run p6-d0.001-gtopk 0.001 gtopk --seeds 0 1 2 "${BASE[@]}"
OTHERS="topka spardl topkdsa gaussiank"
for s in 0 1 2; do
  run p7-d0.01-others-s$s 0.01 $OTHERS --seeds $s "${BASE[@]}"
  run p8-d0.001-others-s$s 0.001 $OTHERS --seeds $s "${BASE[@]}"
done
echo "=== $(date +%T) done"
