#!/usr/bin/env bash
# The CUDA path checked on a GPU machine in one go: build pyserve._C in place for Hopper
# (sm_90a only, to be quick), run the CUDA tests, run benchmarks/gpu_kernels.py. Writes
# gpu_check.log (everything), build.log and gpu_kernels.json into OUT_DIR.
#
#   bash tools/gpu_check.sh OUT_DIR [--dry-run]
#
# Made for a bare H200 machine: python3 with a CUDA torch, nvcc, cmake, ninja, pybind11; no
# network, nothing of ours installed. Set PYTHON to use another interpreter, MAX_JOBS (16) and
# TORCH_CUDA_ARCH_LIST (9.0a) to build otherwise. Steps have deadlines that keep the whole run
# within GPU_CHECK_BUDGET_S (450 s, under the device's 8 minutes), 100 s of it kept for the
# benchmark; a failed test does not stop the benchmark, a failed build stops all. Tests run one
# process per file, so a sticky CUDA error or an import error fails only its own file.
#
# --dry-run runs the same steps here, without a GPU: it reuses the CPU build of pyserve._C
# (other processes may have it loaded, so it is never rebuilt from here), runs the tests (they
# skip) through pytest and through tools/run_cuda_tests.py with its pytest stand-in, and the
# benchmark's --dry-run on the CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: tools/gpu_check.sh OUT_DIR [--dry-run]}
dry=0
[ "${2:-}" = "--dry-run" ] && dry=1
mkdir -p "$out" && out=$(cd "$out" && pwd)
exec > >(tee "$out/gpu_check.log") 2>&1
if [ $dry = 1 ]; then python=${PYTHON:-.venv/bin/python}; else python=${PYTHON:-python3}; fi
python=$(command -v "$python") || { echo "no python at ${PYTHON:-python3}"; exit 1; }
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
[ -x /usr/local/cuda/bin/nvcc ] && export PATH="$PATH:/usr/local/cuda/bin"
start=$(date +%s)
failed=()
budget=${GPU_CHECK_BUDGET_S:-450}
bench_reserve=100
step() { echo; echo "== [$(( $(date +%s) - start ))s] $*"; }
# seconds from now until the absolute time $1, at least $2
until_s() { local s=$(( $1 - $(date +%s) )); echo $(( s < $2 ? $2 : s )); }

step "environment"
"$python" - <<'EOF'
import importlib.util, os, sys, sysconfig
import torch
include = sysconfig.get_paths()["include"]
print(f"python {sys.version.split()[0]} ({sys.executable}); Python.h "
      f"{'found' if os.path.exists(os.path.join(include, 'Python.h')) else 'MISSING'} in {include}")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device {p.name}: {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB")
print("modules:", ", ".join(f"{m} {'yes' if importlib.util.find_spec(m) else 'MISSING'}"
                            for m in ("pytest", "numpy", "pybind11", "safetensors", "transformers", "uvloop")))
EOF
command -v nvcc >/dev/null && nvcc --version | tail -n 1
cmake --version | head -n 1
echo "ninja $(ninja --version 2>/dev/null || echo MISSING)"

step "build"
if [ $dry = 1 ]; then
  "$python" -c "import pyserve._C as c; print('dry run: reusing', c.__file__, '(CUDA:', c.built_with_cuda(), ')')" \
    || { echo "no build of pyserve._C to reuse: run tools/setup.sh first"; exit 1; }
else
  build=build/gpu-check
  prefix=$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)')
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
  build_start=$(date +%s)
  timeout 60 cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
    -DPYSERVE_OUTPUT_DIR="$PWD/pyserve" -DPython_EXECUTABLE="$python" > "$out/build.log" 2>&1 \
    || { tail -n 40 "$out/build.log"; echo "CMake configure failed (build.log)"; exit 1; }
  grep "pyserve._C:" "$out/build.log"
  grep -q "pyserve._C: CUDA=ON" "$out/build.log" || { echo "CMake did not enable CUDA (build.log)"; exit 1; }
  # what is left after at least 120 s of tests and the benchmark's reserve
  timeout "$(until_s $(( start + budget - bench_reserve - 120 )) 60)" \
    cmake --build "$build" -j "${MAX_JOBS:-16}" >> "$out/build.log" 2>&1
  rc=$?
  [ $rc = 124 ] && { tail -n 5 "$out/build.log"; echo "build timed out (build.log)"; exit 1; }
  [ $rc = 0 ] || { grep -B2 -A12 -m 5 "error" "$out/build.log" | head -n 80; echo "build failed (build.log)"; exit 1; }
  echo "built in $(( $(date +%s) - build_start ))s for TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
  "$python" -c "import pyserve._C as c; assert c.built_with_cuda(); print('import ok:', c.__file__)" \
    || { echo "the build does not import"; exit 1; }
fi

step "CUDA tests"
export PYTHONFAULTHANDLER=1
# kernels first, the engine (slowest) last
files=(tests/kernels/test_cuda.py tests/cuda/test_attention.py tests/cuda/test_fused_ops.py
       tests/cuda/test_nccl.py tests/cuda/test_model.py tests/cuda/test_engine_cuda.py
       tests/cuda/test_structured_cuda.py tests/cuda/test_moe.py)
if "$python" -c "import pytest" 2>/dev/null; then
  runner=("$python" -m pytest -m cuda -v -rs --tb=short -p no:cacheprovider -o faulthandler_timeout=90)
else
  echo "pytest missing: tools/run_cuda_tests.py instead"
  runner=("$python" tools/run_cuda_tests.py)
fi
for f in "${files[@]}"; do
  timeout "$(until_s $(( start + budget - bench_reserve )) 20)" "${runner[@]}" "$f" || failed+=("tests: $f")
done
if [ $dry = 1 ]; then
  step "CUDA tests through the fallback runner and its pytest stand-in"
  timeout 240 "$python" tools/run_cuda_tests.py --stub || failed+=("tests (fallback runner)")
fi

step "benchmark"
bench=(-m benchmarks.gpu_kernels --output-json "$out/gpu_kernels.json")
[ $dry = 1 ] && bench+=(--dry-run --device cpu)
timeout "$(until_s $(( start + budget )) 60)" "$python" "${bench[@]}" || failed+=("benchmark")

step "done"
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
echo "all steps passed"
