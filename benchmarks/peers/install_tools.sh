#!/usr/bin/env bash
# A small virtual environment for the peers' tooling, kept out of the repository's .venv:
# matplotlib for run.py's chart, and what llama.cpp's convert_hf_to_gguf.py imports (torch,
# transformers, sentencepiece, numpy, pyyaml, ...). Versions shared with pyserve follow
# requirements.txt. Idempotent.
#
#   bash benchmarks/peers/install_tools.sh      # ~/.cache/pyserve/peers/tools
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
PEERS_DIR=${PYSERVE_PEERS_DIR:-$HOME/.cache/pyserve/peers}
VENV=$PEERS_DIR/tools
STAMP=$VENV/.installed

if [[ -f $STAMP ]]; then
    echo "peers tooling already installed in $VENV"
    exit 0
fi
pin() {  # the requirements.txt line for a package, so both environments agree
    grep -E "^$1==" "$REPO/requirements.txt"
}
mkdir -p "$PEERS_DIR"
[[ -x $VENV/bin/python ]] || "${PYTHON:-python3}" -m venv "$VENV"
nice -n 19 "$VENV/bin/python" -m pip install --quiet "$(pin torch)" "$(pin transformers)" \
    "$(pin tokenizers)" "$(pin safetensors)" "$(pin numpy)" \
    sentencepiece protobuf pyyaml tqdm requests matplotlib
"$VENV/bin/python" -c "import matplotlib, sentencepiece, torch, transformers"
touch "$STAMP"
echo "peers tooling installed in $VENV"
