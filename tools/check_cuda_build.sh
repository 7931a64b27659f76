#!/usr/bin/env bash
# Compiles and links the CUDA build of pyserve._C without a GPU: against the CUDA 13.0 build
# of torch (2.14.1, on this machine's disk) in a cached virtual environment outside the repo,
# with the local nvcc. Skipped, with a note, when nvcc is absent. A CUDA compile error fails.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null 2>&1; then
  echo "[cuda-build] nvcc not found: skipping the CUDA compile check"
  exit 0
fi
venv=${PYSERVE_CUDA_CHECK_VENV:-$HOME/.cache/pyserve/cuda-check-venv}
python=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import torch; assert torch.version.cuda" 2>/dev/null; then
  echo "[cuda-build] creating $venv with torch 2.14.1 (CUDA 13.0)"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check torch==2.14.1 numpy ninja
fi
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
start=$(date +%s)
prefix=$("$venv/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null)
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
  -DPYSERVE_OUTPUT_DIR="$build/out" -DPython_EXECUTABLE="$venv/bin/python" > "$build/configure.log" 2>&1 \
  || { cat "$build/configure.log"; exit 1; }
grep -q "CUDA=ON NCCL=ON" "$build/configure.log" || { echo "[cuda-build] CMake did not enable CUDA and NCCL"; cat "$build/configure.log"; exit 1; }
cmake --build "$build" -j "${MAX_JOBS:-2}"
(cd "$build/out" && "$venv/bin/python" -c "import torch, _C; assert _C.built_with_cuda() and _C.built_with_nccl()")
echo "[cuda-build] CUDA + NCCL build of pyserve._C compiled, linked and imported in $(( $(date +%s) - start ))s"
