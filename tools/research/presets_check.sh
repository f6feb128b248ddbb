#!/usr/bin/env bash
# The presets' check: each transformer preset of oktopk_triton.presets (and the options left out
# of them) trained on the 480k GPT, a model no campaign tuned (another width, depth, context, lr
# and betas than the 1m/4m GPTs the local-steps campaign tuned on), 4 gloo ranks, seeds 0-2,
# against dense data parallel AdamW of the same seeds. One launch per configuration.
#   nohup nice -n 15 tools/research/presets_check.sh OUT_DIR [python] > OUT_DIR/check.log 2>&1 &
#   python -m tools.research.local_steps_screen OUT_DIR --dense ''
# ONLY=variant: the second recipe alone; ONLY=many: the 64-rank runs alone (those already
# recorded in OUT_DIR are kept, not run again)
set -u
OUT=${1:?usage: tools/research/presets_check.sh OUT_DIR [python]}
PY=${2:-python3}
STEPS=${STEPS:-600}
SEEDS=${SEEDS:-0 1 2}
mkdir -p "$OUT"
run() {  # tag, algorithm, density, options...
  local tag=$1 algo=$2 d=$3; shift 3
  local opts=()
  for o in "$@"; do opts+=(--option "$o"); done
  echo "=== $(date +%T) $tag"
  "$PY" -m oktopk_triton.cli train --model gpt --size 480k --steps "$STEPS" --eval-times 10 \
      --seeds $SEEDS --algorithms "$algo" --density "$d" --no-plot --quiet ${TRAIN_ARGS:-} \
      --json "$OUT/$tag.json" ${opts[@]+"${opts[@]}"} || echo "!!! $tag exited with $?"
}
if [ "${ONLY:-}" = variant ]; then
  # the realignment once more, on the 480k GPT trained as plain AdamW is often set (lr 3e-3,
  # betas 0.9/0.999) and for 300 steps: OUT should be a folder of its own (another recipe)
  STEPS=300 TRAIN_ARGS="--lr 3e-3 --betas 0.9 0.999"
  run dense-480k dense 0.01
  run topka-480k-H4-d0.071-q2 topka 0.071 sync_every=4 wire_format=q2
  run topka-480k-H4-d0.071-q2-ra0.3 topka 0.071 sync_every=4 wire_format=q2 moment_realign=0.3
  exit 0
fi
[ "${ONLY:-}" = many ] || {
run dense-480k dense 0.01
# transformer at 2% of dense's bytes (4 ranks): the preset, then the realignment it leaves out
run topka-480k-H4-d0.071-q2 topka 0.071 sync_every=4 wire_format=q2
run topka-480k-H4-d0.071-q2-ra0.3 topka 0.071 sync_every=4 wire_format=q2 moment_realign=0.3
run oktopk-480k-H4-d0.08-compact oktopk 0.08 sync_every=4 wire_format=compact
# transformer at 0.2% of dense's bytes
run topka-480k-H2-d0.0034-q2 topka 0.0034 sync_every=2 wire_format=q2
run oktopk-480k-H4-d0.0138-q2 oktopk 0.0138 sync_every=4 wire_format=q2
}
# many ranks: 64 thread ranks of one process (quality_at_scale), batch 1 per rank, 320 steps,
# seed 0: the preset, the same without consistency, and TopkA's best at 64 ranks (5x the bytes)
if [ "${MANY:-1}" = 1 ]; then
  many() {  # tag, algorithm, density, options...
    local tag=$1 algo=$2 d=$3; shift 3
    local opts=()
    for o in "$@"; do opts+=(--option "$o"); done
    if [ -e "$OUT/$tag.json" ]; then echo "--- $tag recorded already"; return; fi
    echo "=== $(date +%T) $tag"
    "$PY" -m tools.research.quality_at_scale --world-size 64 --size 480k --steps 320 \
        --batch-size 1 --seeds 0 --algorithms "$algo" --density "$d" --progress 0 --timeout 7200 \
        --json "$OUT/$tag.json" ${opts[@]+"${opts[@]}"} || echo "!!! $tag exited with $?"
  }
  many p64-480k-oktopk-H2-d0.0142-complete-cons0.9 oktopk 0.0142 sync_every=2 wire_format=q2 \
      complete_sums=true consistency=0.9
  many p64-480k-oktopk-H2-d0.0142-complete oktopk 0.0142 sync_every=2 wire_format=q2 \
      complete_sums=true
  many p64-480k-topka-H2-d0.0025 topka 0.0025 sync_every=2 wire_format=q2
fi
echo "=== $(date +%T) done"
