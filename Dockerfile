# The training image: a pinned CUDA 13.0 base, Python 3.11 and the very same requirements.lock
# that `make venv` installs, so package versions are identical in the venv, here and in CI.
# Build it with `make image` (docs/container.md shows the plain docker command); it needs
# BuildKit (docker 23 and newer by default; DOCKER_BUILDKIT=1 for docker 18.09 to 20.10).
#
# Build arguments:
#   BASE_IMAGE   the CUDA base, an exact, fully versioned tag (never latest or a bare major)
#   BASE_DIGEST  sha256 digest of BASE_IMAGE; the default below is the recorded one, written by
#                `make image-digest` where a registry is reachable (empty: the tag alone)
#   IMAGE_TAG    the tag this image is built as           -> RECIPES_IMAGE
#   GIT_SHA      `git rev-parse HEAD` of the source       -> RECIPES_GIT_SHA
#   LOCK_SHA256  sha256 of requirements.lock (required; checked against the copied lock)
#                                                         -> RECIPES_LOCK_SHA256
# RECIPES_IMAGE_DIGEST carries BASE_DIGEST. The engine copies all RECIPES_* into env.json.
#
# Why this base. torch 2.14.1 from PyPI is a CUDA 13.0 build that brings its own CUDA libraries
# (the nvidia-* wheels of the lock: cuBLAS, cuDNN, NCCL, ...), so the image needs CUDA 13.0's
# "base" flavour only (cudart, driver forward-compatibility, the NVIDIA container runtime
# settings); "runtime" or "cudnn-runtime" would add a second copy of libraries torch never
# loads. 13.0.2 is the CUDA 13.0 update whose runtime (13.0.96) the lock's
# nvidia-cuda-runtime wheel carries. Ubuntu 22.04 because its own archive ships python3.11,
# the lock's Python minor version (24.04 ships only 3.12; 3.11 there needs a third-party PPA),
# and because it has no user with uid 1000 that `trainer` would collide with.
ARG BASE_IMAGE=nvidia/cuda:13.0.2-base-ubuntu22.04
ARG BASE_DIGEST=
FROM ${BASE_IMAGE}${BASE_DIGEST:+@}${BASE_DIGEST}

ARG PYTHON_VERSION=3.11
# The pip that installed and froze the lock (a freeze by another pip may format differently).
ARG PIP_VERSION=23.2.1
ARG DEBIAN_FRONTEND=noninteractive
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# System layer. Python with its headers and a C/C++ compiler: triton builds its launcher and
# torch.compile its CPU kernels at run time. git reads the state of a mounted source.
# Ubuntu keeps only the newest build of a package in -updates/-security, so an exact apt pin
# breaks the build at the next security fix (DL3008); the Python minor version is pinned by the
# package name, every Python package by the lock.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        "python${PYTHON_VERSION}" "python${PYTHON_VERSION}-venv" "python${PYTHON_VERSION}-dev" \
        gcc g++ libc6-dev git ca-certificates \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
# A site behind a proxy gives pip its CA bundle and package index as BuildKit secrets
# (make image CA_BUNDLE=... PIP_INDEX_URL=...): mounted for one RUN, never in a layer, a label
# or the image's history; docker/pip-site.sh exports those that were given as pip's variables.
RUN --mount=type=secret,id=ca_bundle --mount=type=secret,id=pip_index_url \
    --mount=type=secret,id=pip_extra_index_url --mount=type=secret,id=pip_trusted_host \
    --mount=type=bind,source=docker/pip-site.sh,target=/tmp/pip-site.sh \
    "python${PYTHON_VERSION}" -m venv /opt/venv \
    && . /tmp/pip-site.sh \
    && pip install --no-cache-dir "pip==${PIP_VERSION}"

# The lock layer: only a change of requirements.lock reinstalls torch (the source comes last).
# The build fails unless the lock is the one LOCK_SHA256 names, every package installs at the
# locked version, and `pip freeze` of the result equals the lock line for line.
COPY requirements.lock /opt/venv/requirements.lock
ARG LOCK_SHA256=
RUN --mount=type=secret,id=ca_bundle --mount=type=secret,id=pip_index_url \
    --mount=type=secret,id=pip_extra_index_url --mount=type=secret,id=pip_trusted_host \
    --mount=type=bind,source=docker/pip-site.sh,target=/tmp/pip-site.sh \
    if [ -z "${LOCK_SHA256}" ]; then \
        echo "LOCK_SHA256 build arg missing: use make image, or pass --build-arg LOCK_SHA256=\$(sha256sum requirements.lock | cut -d' ' -f1)" >&2; \
        exit 1; \
    fi \
    && echo "${LOCK_SHA256}  /opt/venv/requirements.lock" | sha256sum --check --strict \
    && . /tmp/pip-site.sh \
    && pip install --no-cache-dir -r /opt/venv/requirements.lock \
    && pip check \
    && grep -v '^#' /opt/venv/requirements.lock > /tmp/locked.txt \
    && pip freeze | diff /tmp/locked.txt - \
    && rm /tmp/locked.txt \
    && chmod -R a+rX /opt/venv

# A non-root user; the image also runs as any host uid (`docker run -u UID:GID`): HOME is a
# world-writable /tmp/home (caches of pip, triton and W&B derive from it; torch.compile's cache
# falls back to /tmp/torchinductor_uid_N without a passwd entry), the venv is read-only for all.
# W&B needs no network: without credentials (-e WANDB_API_KEY) the engine logs offline.
RUN useradd --uid 1000 --user-group --create-home --shell /bin/bash trainer \
    && mkdir -p /workspace/runs /data /tmp/home \
    && chown trainer:trainer /workspace \
    && chmod 1777 /workspace/runs /tmp/home
ENV HOME=/tmp/home \
    RECIPES_DATA=/data

# Provenance, declared after the heavy layers so a new commit rebuilds nothing above.
ARG BASE_IMAGE
ARG BASE_DIGEST
ARG IMAGE_TAG=recipes:dev
ARG GIT_SHA=unknown
LABEL org.opencontainers.image.title="recipes" \
      org.opencontainers.image.description="Reproducible PyTorch training recipes" \
      org.opencontainers.image.ref.name="${IMAGE_TAG}" \
      org.opencontainers.image.revision="${GIT_SHA}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      org.opencontainers.image.base.digest="${BASE_DIGEST}" \
      io.recipes.lock.sha256="${LOCK_SHA256}"
ENV RECIPES_IMAGE="${IMAGE_TAG}" \
    RECIPES_IMAGE_DIGEST="${BASE_DIGEST}" \
    RECIPES_BASE_IMAGE="${BASE_IMAGE}" \
    RECIPES_GIT_SHA="${GIT_SHA}" \
    RECIPES_LOCK_SHA256="${LOCK_SHA256}"

# The source, last: a code change rebuilds only this layer. `docker run` mounts the host
# source over it.
COPY . /workspace
USER 1000:1000
WORKDIR /workspace
CMD ["python", "-m", "engine.train", "digits"]
