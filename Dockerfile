# syntax=docker/dockerfile:1
# One image for every gpujobs process: migrations, the API and GPU workers (compose.yaml picks the command).
#
# python-slim plus PyTorch's CUDA wheels: the wheels carry the CUDA user-space libraries (cuBLAS, cuDNN, NCCL),
# so no nvidia/cuda base image is needed. The host provides the driver through the NVIDIA Container Toolkit.
#
#   docker build -t gpujobs .
#   docker build -t gpujobs --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .   # older driver
ARG PYTHON_VERSION=3.12
FROM python:${PYTHON_VERSION}-slim

# PyPI's torch wheel for Linux (x86_64 and aarch64) is a CUDA 13.0 build: it needs an NVIDIA driver >= 580.
# For an older driver, take a CUDA 12.x build from PyTorch's own index (TORCH_INDEX_URL, above).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=
ARG EXTRAS=gpu,postgres

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    JOBS_HOME=/var/lib/gpujobs \
    JOBS_ARTIFACTS=/var/lib/gpujobs/artifacts

# An unprivileged user. Named volumes mounted on these folders start with this ownership.
RUN groupadd --system --gid 1000 jobs \
 && useradd --system --uid 1000 --gid jobs --home-dir /var/lib/gpujobs --shell /usr/sbin/nologin jobs \
 && mkdir -p /var/lib/gpujobs/artifacts /var/lib/gpujobs/huggingface /models /data \
 && chown -R jobs:jobs /var/lib/gpujobs

# torch first, in a layer of its own: by far the largest download, and it changes less often than the code.
# hadolint ignore=DL3013
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"

# The project, its dependencies at the versions CI tested (constraints.txt does not pin torch, so pip keeps the
# torch installed above; the check after it fails the build if anything replaced it). `python -m api` is the
# `jobs` program: in sh and bash, `jobs` is the shell's builtin, which hides the program of that name.
COPY . /tmp/gpujobs
# hadolint ignore=DL3013
RUN pip install -c /tmp/gpujobs/constraints.txt "/tmp/gpujobs[${EXTRAS}]" \
 && python -c "import importlib.metadata as m, os; v = m.version('torch'); \
assert v.split('+')[0] == os.environ['TORCH_VERSION'], f'torch was replaced: {v}'" \
 && rm -rf /tmp/gpujobs \
 && python -m api --version

USER 1000:1000
WORKDIR /var/lib/gpujobs
EXPOSE 8765
CMD ["python", "-m", "uvicorn", "api.app:app", "--host", "0.0.0.0", "--port", "8765"]
