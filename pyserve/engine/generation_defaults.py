"""Default sampling parameters from a model's generation_config.json, as vLLM applies them
(`--generation-config auto`): a request that leaves one of these fields out gets the model's
value instead of the built-in default; `vllm` ignores the file; a folder reads its file."""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger("pyserve")

# generation_config.json key -> SamplingParams field
_KEYS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature", "top_k": "top_k",
         "top_p": "top_p", "min_p": "min_p", "presence_penalty": "presence_penalty",
         "frequency_penalty": "frequency_penalty", "max_new_tokens": "max_tokens"}


def load_generation_defaults(setting: str, model_dir: Path) -> dict:
    """{SamplingParams field: value} from generation_config.json; empty for `vllm` or no file."""
    if setting == "vllm":
        return {}
    folder = model_dir if setting == "auto" else Path(setting)
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        logger.warning("ignoring %s: %s", path, exc)
        return {}
    # do_sample false (transformers' greedy) says nothing about the server's sampling: vLLM
    # ignores it too
    defaults = {field: raw[key] for key, field in _KEYS.items()
                if isinstance(raw.get(key), (int, float)) and not isinstance(raw.get(key), bool)}
    if defaults:
        logger.info("default sampling parameters from %s: %s", path, defaults)
    return defaults
