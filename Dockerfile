# duet: the search service and the index builder in one image.
#
#   docker build -t duet:gpu .                        # default: CUDA 12.6 base, CUDA torch, faiss-gpu
#   docker build -t duet:cpu --build-arg FLAVOR=cpu . # Python slim, CPU torch, faiss-cpu
#
# Both flavours run the same way: non-root user `duet`, `duet serve` on port 8000,
# indexes on the /data/indexes volume, the shipped model weights inside the image.

ARG FLAVOR=gpu
ARG PYTHON_IMAGE=python:3.12-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.6.3-base-ubuntu24.04

# ---- operating system + Python, per flavour -------------------------------------------
FROM ${PYTHON_IMAGE} AS os-cpu
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
    FAISS_PACKAGE=faiss-cpu

FROM ${CUDA_IMAGE} AS os-gpu
# Ubuntu 24.04's Python 3.12. The base image brings only the NVIDIA runtime hooks
# (NVIDIA_* variables); the CUDA libraries come as pip wheels with torch cu126, and
# faiss-gpu-cu12 links those same wheels. Needs an NVIDIA driver for CUDA 12.6 (>= 560,
# or an older one with forward compatibility; NVIDIA_DISABLE_REQUIRE=1 skips the check).
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/*
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 \
    FAISS_PACKAGE=faiss-gpu-cu12

# ---- build: a virtual environment with torch, faiss and duet --------------------------
# hadolint ignore=DL3006
FROM os-${FLAVOR} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
# torch first, from the flavour's wheel index, so duet's own `torch>=2.3` range is already met
RUN python3 -m venv /opt/venv \
 && pip install --no-cache-dir "torch>=2.3,<3" --index-url "${TORCH_INDEX_URL}"
WORKDIR /src
COPY pyproject.toml README.md ./
# the other dependencies (a cached layer until pyproject.toml changes), with the flavour's FAISS
RUN python3 -c "import os, tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; print('\n'.join(os.environ['FAISS_PACKAGE'] if d.startswith('faiss-cpu') else d for d in deps if not d.startswith('torch')))" > /tmp/requirements.txt \
 && pip install --no-cache-dir -r /tmp/requirements.txt
COPY app ./app
COPY duet ./duet
COPY index_builder ./index_builder
COPY store ./store
COPY models ./models
# --no-deps: the dependencies are in place (faiss-gpu stands in for faiss-cpu on GPU images)
# smoke test: torch, faiss and the shipped weights load
RUN pip install --no-cache-dir --no-deps . \
 && python3 -c "import faiss, torch; from models.builtin import BuiltinModel; BuiltinModel.load()"

# ---- runtime ------------------------------------------------------------------------
# hadolint ignore=DL3006
FROM os-${FLAVOR} AS runtime
ARG FLAVOR
LABEL org.opencontainers.image.title="duet" \
      org.opencontainers.image.description="Image-text retrieval: FAISS top-M, cross-encoder re-rank" \
      org.opencontainers.image.licenses="Apache-2.0" \
      ai.duet.flavor="${FLAVOR}"
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/duet duet \
 && mkdir -p /data/indexes \
 && chown duet:duet /data/indexes
COPY --from=build /opt/venv /opt/venv
# ONEDNN_PRIMITIVE_CACHE_CAPACITY=8: torch's CPU kernels keep at most 8 primitives, not one
# per input shape (a mix of search sizes grew a replica by gigabytes; 0 slows every encode;
# duet/commands/serve.py says more)
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    ONEDNN_PRIMITIVE_CACHE_CAPACITY=8 \
    DUET_INDEX_DIR=/data/indexes \
    DUET_HOST=0.0.0.0 \
    DUET_PORT=8000 \
    DUET_HEALTH_PORT=8001
USER 10001:10001
WORKDIR /home/duet
VOLUME ["/data/indexes"]
# 8001: /healthz alone, answered by a thread while the event loop works through a storm
EXPOSE 8000 8001
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 CMD ["duet", "healthcheck"]
ENTRYPOINT ["duet"]
CMD ["serve"]
