"""llama.cpp's own converter, convert_hf_to_gguf.py, run on a Hugging Face model directory:
the GGUF files llama.cpp users have, for tests that must read what llama.cpp writes.

The converter and its gguf-py come from the llama-cpp-python sdist (the version
benchmarks/peers builds llama-server from), downloaded once from PyPI into
~/.cache/pyserve/peers/llama.cpp (PYSERVE_PEERS_DIR), the folder install_llamacpp.sh uses. It
runs in this Python (torch, transformers, numpy and sentencepiece are in requirements.txt).

    python tools/llamacpp_convert.py MODEL_DIR OUT.gguf [--outtype f32]
"""

from __future__ import annotations

import argparse
import fcntl
import os
import subprocess
import sys
import tarfile
from pathlib import Path

VERSION = "0.3.36"  # benchmarks/peers/install_llamacpp.sh's


def llamacpp_source() -> Path:
    """The sdist's vendored llama.cpp folder, fetched and unpacked on first use."""
    root = Path(os.environ.get("PYSERVE_PEERS_DIR") or Path.home() / ".cache" / "pyserve" / "peers") / "llama.cpp"
    src = root / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if (src / "convert_hf_to_gguf.py").exists():
        return src
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".sdist.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one download when several runs start at once
        if not (src / "convert_hf_to_gguf.py").exists():
            sdist = root / f"llama_cpp_python-{VERSION}.tar.gz"
            if not sdist.exists():
                subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                                "--no-binary", ":all:", f"llama-cpp-python=={VERSION}", "-d", str(root)],
                               check=True, timeout=900)
            with tarfile.open(sdist) as tar:
                tar.extractall(root, filter="data")
    return src


def convert(model_dir: str | Path, out: str | Path, outtype: str = "f32", extra: tuple[str, ...] = ()) -> Path:
    """model_dir converted by llama.cpp's converter into the GGUF file out; extra: more of its
    flags (--no-mtp for a Qwen3.5 / Qwen3-Next without multi-token prediction layers)."""
    src = llamacpp_source()
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}  # the gguf-py of that llama.cpp
    done = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(model_dir),
                           "--outtype", outtype, "--outfile", str(out), *extra],
                          env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return Path(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("out")
    parser.add_argument("--outtype", default="f32")
    args = parser.parse_args()
    print(convert(args.model_dir, args.out, args.outtype))


if __name__ == "__main__":
    main()
