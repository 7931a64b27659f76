"""Turns --model (a directory, a .gguf file, or nothing for the default model) into a checked
model directory, before any weights load. Every failure is one ModelLoadError that says
what is wrong and what to do."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from pyserve.config import ModelConfig
from pyserve.model.arch import ModelArch
from pyserve.model.default_model import DEFAULT_MODEL_NAME, fetch_default_gguf
from pyserve.errors import ModelLoadError
from pyserve.model.gguf import CONVERSION, gguf_metadata_dir
from pyserve.model.registry import model_class

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class ModelSource:
    path: Path  # a Hugging Face style model directory (for a GGUF: its metadata, no weights)
    tokenizer_path: Path
    arch: ModelArch
    hf_config: dict
    name: str  # the name the API reports
    gguf_path: Path | None = None  # a GGUF model: the file its weights are read from, in place


def _gguf_metadata(gguf: Path, download_dir: str) -> Path:
    """The GGUF's config and tokenizer directory, made once per file (its weights stay in
    the file)."""
    stat = gguf.stat()
    made_from = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{CONVERSION}"
    key = hashlib.sha256(made_from.encode()).hexdigest()
    out = Path(download_dir) / "converted" / f"{gguf.stem}-{key[:12]}"
    if (out / "config.json").exists():
        return out
    return gguf_metadata_dir(gguf, out)


def _read_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.exists():
        raise ModelLoadError(f"'{path}' has no config.json: it is not a Hugging Face model "
                             "directory (pass a model directory or a .gguf file)")
    try:
        cfg = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"'{config_file}' is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"'{config_file}' must hold a JSON object")
    return cfg


def resolve_model(cfg: ModelConfig) -> ModelSource:
    gguf_path = None
    if cfg.model is None:
        # the default model is a GGUF: its own quantized weights, read in place
        gguf_path = fetch_default_gguf(cfg.download_dir)
        path, default_name = _gguf_metadata(gguf_path, cfg.download_dir), DEFAULT_MODEL_NAME
    else:
        given = Path(cfg.model).expanduser()
        if not given.exists():
            raise ModelLoadError(f"model path '{given}' does not exist")
        if given.is_file():
            if given.suffix != ".gguf":
                raise ModelLoadError(f"'{given}' is a file but not a .gguf; pass a model "
                                     "directory or a .gguf file")
            path, gguf_path = _gguf_metadata(given, cfg.download_dir), given
        else:
            path = given
        default_name = str(cfg.model)

    hf_config = _read_config(path)
    arch = ModelArch.from_hf_config(hf_config)
    model_class(arch.architecture)  # refuses unsupported architectures, listing ours

    if gguf_path is None and cfg.load_format != "dummy" and not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"'{path}' holds no *.safetensors weights "
                             "(use --load-format dummy for random weights)")
    tokenizer_path = Path(cfg.tokenizer).expanduser() if cfg.tokenizer else path
    if not any((tokenizer_path / f).exists() for f in _TOKENIZER_FILES):
        raise ModelLoadError(f"no tokenizer in '{tokenizer_path}' (looked for "
                             f"{', '.join(_TOKENIZER_FILES)}); pass --tokenizer DIR")
    return ModelSource(path=path, tokenizer_path=tokenizer_path, arch=arch, hf_config=hf_config,
                       name=cfg.served_model_name[0] if cfg.served_model_name else default_name, gguf_path=gguf_path)
