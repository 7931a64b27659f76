"""Default sampling parameters from a model's generation_config.json, as vLLM applies them
(`--generation-config auto`): a request that leaves one of these fields out gets the model's
value instead of the built-in default; `vllm` ignores the file; a folder reads its file.
`--override-generation-config` is laid over whichever of these applies (`vllm` included), in
the file's names (max_new_tokens) or SamplingParams' (max_tokens)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger("pyserve")

# generation_config.json key -> SamplingParams field
_KEYS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature", "top_k": "top_k",
         "top_p": "top_p", "min_p": "min_p", "presence_penalty": "presence_penalty",
         "frequency_penalty": "frequency_penalty", "max_new_tokens": "max_tokens"}


def load_generation_defaults(setting: str, model_dir: Path,
                             override: Iterable[tuple[str, object]] = ()) -> dict:
    """{SamplingParams field: value} from generation_config.json (none for `vllm` or no file),
    with the override's items laid over them."""
    defaults = _from_file(setting, model_dir)
    overridden = _override(override)
    if overridden:
        defaults.update(overridden)
        logger.info("default sampling parameters with --override-generation-config: %s", defaults)
    return defaults


def _from_file(setting: str, model_dir: Path) -> dict:
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
    defaults = {field: raw[key] for key, field in _KEYS.items() if _is_number(raw.get(key))}
    if defaults:
        logger.info("default sampling parameters from %s: %s", path, defaults)
    return defaults


def _override(items: Iterable[tuple[str, object]]) -> dict:
    fields = set(_KEYS.values())
    out = {}
    for key, value in items:
        field = _KEYS.get(key, key if key in fields else None)
        if field is None or not _is_number(value):
            logger.warning("--override-generation-config: ignoring %s=%r (it takes numbers for "
                           "%s)", key, value, ", ".join(_KEYS))
            continue
        out[field] = value
    return out


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
