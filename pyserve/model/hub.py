"""A Hugging Face model id given as the model (`pyserve serve Qwen/Qwen3-0.6B`, as vLLM takes
it) -> the local snapshot directory: the Hugging Face cache's copy when there is one (the only
place looked with HF_HUB_OFFLINE=1), else downloaded into that cache. Only what serving reads
is fetched: configs, tokenizer files, chat templates and safetensors weights."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

# what a model directory needs here; *.bin / *.pt / *.gguf / images are left on the hub
_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "tokenizer*")
# Mistral's own checkpoint format, beside the Hugging Face one, and repositories' originals
_SKIPPED = ("consolidated*.safetensors", "original/*")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_hub_id(model: str) -> bool:
    """An org/name the file system does not have."""
    return not os.path.exists(model) and _HUB_ID.fullmatch(model) is not None


def _cache_dir(environ: Mapping[str, str]) -> str | None:
    """The hub cache the environment names (HF_HUB_CACHE, else HF_HOME/hub), or None for the
    library's default."""
    if environ.get("HF_HUB_CACHE"):
        return environ["HF_HUB_CACHE"]
    if environ.get("HF_HOME"):
        return os.path.join(environ["HF_HOME"], "hub")
    return None


def resolve_hub_model(model: str, revision: str | None, token: str | None,
                      environ: Mapping[str, str]) -> str:
    """The snapshot directory of hub id `model` at `revision` (None: main). Raises ValueError
    saying why when it is neither cached nor downloadable."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # transformers depends on it; say so if it is gone
        raise ValueError(f"'{model}' is not a local path, and huggingface_hub is not installed "
                         "to fetch it") from exc
    cache_dir = _cache_dir(environ)
    offline = environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")

    def snapshot(**kw) -> str:
        return snapshot_download(model, revision=revision, cache_dir=cache_dir,
                                 allow_patterns=list(_FILES), ignore_patterns=list(_SKIPPED), **kw)

    try:
        cached = snapshot(local_files_only=True)
    except Exception:  # not in the cache
        cached = None
    if cached is not None and _servable(cached):
        return cached
    if offline:  # a tokenizer alone (AutoTokenizer's download) is no model either
        raise ValueError(f"'{model}' is not a local path and not whole in the Hugging Face cache "
                         f"({cache_dir or 'the default one'}), and HF_HUB_OFFLINE is set")
    try:
        return snapshot(token=token or environ.get("HF_TOKEN"))
    except Exception as exc:
        raise ValueError(f"'{model}' is not a local path, and fetching it from the Hugging Face "
                         f"hub failed: {type(exc).__name__}: {exc}") from exc


def _servable(directory: str) -> bool:
    """A snapshot with a config and weights (the cache may hold a model's tokenizer alone)."""
    return os.path.exists(os.path.join(directory, "config.json")) and any(
        name.endswith(".safetensors") for name in os.listdir(directory))
