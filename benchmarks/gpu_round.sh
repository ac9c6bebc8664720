#!/usr/bin/env bash
# One round of cross-encoder fine-tunes on a GPU host, chosen on validation splits only:
#   1. (TESTS=1) the tests that need CUDA, beside the training;
#   2. the fine-tunes in SPECS, all at once on the one GPU: `duet train --from $BASE --ce-warm
#      --han-steps 0 --ce-lr 3e-4 --ce-mine 50 --ce-move 0.5 --ce-hard H --ce-hard-parts
#      --ce-steps STEPS --seed SEED --device cuda` (about 140 s each, four side by side, H100);
#   3. the soups in SOUPS, each the mean of $BASE and its sources (`duet soup`);
#   4. `models.ce_depth` on the six validation splits for each soup (fp32 on the GPU: the same
#      figures as on the CPU, to the last digit, for the weights shipped before), then
#      `models.tune_fusion` for the soup that loses fewest captions (ties: best R@1 at M = 50).
# Each step gets what is left of BUDGET seconds (less 30 s to pack up), so a slow step cuts the
# next rather than losing the run. Results in $OUT: ftNAME.safetensors for each fine-tune (at
# most 7; rebuild a soup here with `duet soup`, the mean is the same to the bit) and
# results.tgz (log.txt, every log, the depth reports as JSON, the fusion sweep, train.json's).
#
#   BASE=models/weights SPECS="R:18:1200:0.25 S:19:1200:0.25 T:20:1200:0.5 U:21:1200:0.5" \
#     SOUPS="sRS=R,S sTU=T,U sRSTU=R,S,T,U" BUDGET=370 bash benchmarks/gpu_round.sh
#
# SPECS: NAME:SEED:STEPS:HARD each; SOUPS: NAME=SRC,SRC,... each, a SRC a fine-tune's NAME or a
# model directory (made `--from $BASE`). The host needs duet's wheels as benchmarks/gpu_check.sh
# says (WHEELS, default .whl). SMOKE=1 runs every step on the CPU, small (fine-tunes of 4 steps
# on 300 scenes, one split of 20 images): a check of the script, not of the model; about 10
# minutes on 2 cores, so give it BUDGET=900.
set -u
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
BASE=${BASE:-models/weights}
SPECS=${SPECS:-R:18:1200:0.25 S:19:1200:0.25 T:20:1200:0.5 U:21:1200:0.5}
SOUPS=${SOUPS:-sRS=R,S sTU=T,U sRSTU=R,S,T,U}
OUT=${OUT:-gpu-out}
WHEELS=${WHEELS:-.whl}
SEEDS=999999,999997,999995,999993,999991,999989
DEV=cuda SIZE="" EVAL=""
if [ -n "${SMOKE:-}" ]; then
  DEV=cpu SIZE="--images 300 --ce-mine 5" EVAL="--images 20" SEEDS=999999
fi
W=$(mktemp -d)
LOG=$W/log.txt
T0=$(date +%s)
END=$((T0 + ${BUDGET:-540}))
mkdir -p "$OUT"
el() { echo "=== [$(($(date +%s) - T0))s] $*" | tee -a "$LOG"; }
left() { # left MAX: seconds a step may take, at most MAX
  local l=$((END - $(date +%s) - 30))
  echo $((l < $1 ? (l > 1 ? l : 1) : $1))
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null | tee "$LOG"
if [ -z "${SMOKE:-}" ] && compgen -G "$WHEELS/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$WHEELS"/*.whl ||
    exit 3
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
el "round from $BASE: $SPECS"

if [ -n "${TESTS:-}" ]; then
  OMP_NUM_THREADS=2 timeout "$(left 240)" python3 -m pytest -q -p no:cacheprovider -rfs \
    tests/test_model.py tests/test_gpu_search.py tests/test_builder_ann.py \
    tests/test_inference.py tests/test_train_device.py >"$W/cuda_tests.log" 2>&1 &
fi
pids=()
for spec in $SPECS; do
  IFS=: read -r n seed steps hard <<<"$spec"
  [ -n "${SMOKE:-}" ] && steps=4
  # shellcheck disable=SC2086  # SIZE is a list of options
  OMP_NUM_THREADS=3 timeout "$(left 300)" python3 -m duet.cli train --out "$W/ft$n" --seed "$seed" \
    --from "$BASE" --han-steps 0 --ce-warm --ce-steps "$steps" --ce-lr 3e-4 --ce-mine 50 \
    --ce-move 0.5 --ce-hard "$hard" --ce-hard-parts --device "$DEV" --no-progress $SIZE \
    >"$W/ft$n.log" 2>&1 &
  pids+=($!)
done
wait "${pids[@]}"
for spec in $SPECS; do
  n=${spec%%:*}
  grep -h "below 0\|trained in" "$W/ft$n.log" | tee -a "$LOG"
  [ -f "$W/ft$n/model.safetensors" ] && cp "$W/ft$n/model.safetensors" "$OUT/ft$n.safetensors"
done
el "fine-tunes done"

pids=() made=()
for s in $SOUPS; do
  name=${s%%=*} srcs=()
  IFS=, read -ra parts <<<"${s#*=}"
  for src in "${parts[@]}"; do
    [ -d "$W/ft$src" ] && srcs+=("$W/ft$src") || srcs+=("$src")
  done
  OMP_NUM_THREADS=2 python3 -m duet.cli soup --out "$W/$name" "$BASE" "${srcs[@]}" \
    >"$W/$name.log" 2>&1 &
  pids+=($!) made+=("$name")
done
[ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"
soups=()
for name in "${made[@]}"; do [ -f "$W/$name/model.safetensors" ] && soups+=("$name"); done
el "soups: ${soups[*]}"

pids=()
for c in "${soups[@]}"; do
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=2 timeout "$(left 200)" python3 -m models.ce_depth --device "$DEV" --json \
    --model-dir "$W/$c" --seeds "$SEEDS" $EVAL >"$W/depth_$c.json" 2>"$W/depth_$c.err" &
  pids+=($!)
done
[ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"
best=$(python3 - "$W" "${soups[@]}" <<'PY' 2>&1 | tee -a "$LOG" | tail -1
import json, sys
work, rows = sys.argv[1], []
for c in sys.argv[2:]:
    try:
        p = json.load(open(f"{work}/depth_{c}.json"))["pooled"]
    except (OSError, ValueError) as exc:
        print(c, "has no depth report:", exc)
        continue
    t, i = p["t2i"], p["i2t"]
    print(f"{c}: t2i R@1 {t['R@1']} lost {t['lost']} won {t['won']}; i2t R@1 {i['R@1']}")
    rows.append((t["lost"], -max(t["R@1"].values()), c))
print(min(rows)[2] if rows else "")
PY
)
el "depth reports done; tune_fusion for ${best:-nothing}"
if [ -n "$best" ]; then
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=8 timeout "$(left 200)" python3 -m models.tune_fusion --device "$DEV" \
    --candidates 50 --model-dir "$W/$best" --seeds "$SEEDS" $EVAL >"$W/fuse_$best.txt" 2>&1
  grep -E '"ADD_0.0"|"ADD_0.1"|"ADD_0.2"|best' "$W/fuse_$best.txt" | tee -a "$LOG"
fi
[ -f "$W/cuda_tests.log" ] && tail -4 "$W/cuda_tests.log" | tee -a "$LOG"
el done
(cd "$W" && tar czf - --exclude='*.safetensors' --exclude='*.bin' ./*) >"$OUT/results.tgz"
ls -la "$OUT"
