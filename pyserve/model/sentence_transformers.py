"""How a sentence-transformers directory turns token states into one embedding: its
modules.json pipeline (Transformer -> Pooling -> optional Normalize), the pooling mode, and
the longest input it embeds. Pure file reading.

Both spellings of the module types are read: `sentence_transformers.models.Pooling` (ST
before 6) and the module paths ST 6 writes (`sentence_transformers.sentence_transformer.
modules.pooling.Pooling`, `sentence_transformers.base.modules.normalize.Normalize`, ...); the
class name decides. The pooling config is either ST 6's `pooling_mode` ("mean", or a list) or
the older `pooling_mode_*_token(s)` flags (none set means mean, as ST reads them)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pyserve.errors import ModelLoadError

# ST's pooling mode names -> ours
_POOLING = {"mean": "MEAN", "cls": "CLS", "lasttoken": "LAST"}
_LEGACY_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                 "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens":
                 "mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens": "weightedmean",
                 "pooling_mode_lasttoken": "lasttoken"}
# module classes that leave the embedding as it is
_PASSIVE = ("Dropout",)
# transformers' "no limit" model_max_length (VERY_LARGE_INTEGER) and anything near it
_NO_LIMIT = 10 ** 12


@dataclass(frozen=True)
class EncoderPooling:
    pooling_type: str  # "MEAN" | "CLS" | "LAST"
    normalize: bool  # L2-normalized after pooling
    max_seq_length: int | None  # sentence-transformers truncates inputs to this many tokens


def _read_json(path: Path) -> dict | list:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError:
        return {}
    except ValueError as exc:
        raise ModelLoadError(f"'{path}' is not valid JSON: {exc}") from None


def _pooling_mode(config: dict, where: Path) -> str:
    mode = config.get("pooling_mode")
    if mode is None:
        modes = [m for flag, m in _LEGACY_FLAGS.items() if config.get(flag)] or ["mean"]
    else:
        modes = [mode] if isinstance(mode, str) else list(mode)
    if len(modes) != 1:
        raise ModelLoadError(f"'{where}' concatenates the pooling modes {', '.join(modes)}; "
                             "pyserve pools with one of mean, cls, lasttoken")
    if modes[0] not in _POOLING:
        raise ModelLoadError(f"'{where}' pools with '{modes[0]}'; pyserve pools with one of "
                             "mean, cls, lasttoken")
    return _POOLING[modes[0]]


def _max_seq_length(module_dir: Path) -> int | None:
    """As ST 6 resolves it in the Transformer module's folder: a model_max_length among its
    tokenizer arguments, else sentence_bert_config.json's max_seq_length, else the tokenizer's
    model_max_length capped at the model's max_position_embeddings."""
    config = _read_json(module_dir / "sentence_bert_config.json")
    if config.get("do_lower_case"):
        raise ModelLoadError(f"'{module_dir}' lowercases its inputs (do_lower_case) outside the "
                             "tokenizer, which pyserve does not do")
    tokenizer_args = config.get("processor_kwargs") or config.get("tokenizer_args") or {}
    for given in (tokenizer_args.get("model_max_length"), config.get("max_seq_length")):
        if isinstance(given, int) and given > 0:
            return given
        if given is not None:
            raise ModelLoadError(f"'{module_dir / 'sentence_bert_config.json'}' has a bad maximum "
                                 f"sequence length: {given!r}")
    limit = _read_json(module_dir / "tokenizer_config.json").get("model_max_length")
    positions = _read_json(module_dir / "config.json").get("max_position_embeddings")
    if isinstance(positions, int) and positions > 0:
        limit = positions if limit is None else min(int(limit), positions)
    return None if limit is None or limit >= _NO_LIMIT else int(limit)


def read_sentence_transformers(path: Path) -> EncoderPooling | None:
    """The pooling of the sentence-transformers model in directory `path`; None when it has
    no modules.json (a plain transformers model)."""
    path = Path(path)
    if not (path / "modules.json").exists():
        return None
    modules = _read_json(path / "modules.json")
    if not isinstance(modules, list):
        raise ModelLoadError(f"'{path / 'modules.json'}' is not a list of modules")
    pooling, normalize, module_dir = None, False, path
    for module in modules:
        type_name = str(module.get("type", ""))
        # the class name, in whichever module path the ST version wrote it
        ours = type_name.startswith("sentence_transformers.")
        kind = type_name.rsplit(".", 1)[-1] if ours else None
        folder = path / module.get("path", "")
        if kind == "Transformer":
            module_dir = folder
        elif kind == "Pooling" and pooling is None:
            pooling = _pooling_mode(_read_json(folder / "config.json"), folder / "config.json")
        elif kind == "Normalize":
            normalize = True
        elif kind not in _PASSIVE:
            raise ModelLoadError(f"'{path / 'modules.json'}' has a '{type_name}' module; pyserve "
                                 "runs Transformer, Pooling and Normalize modules only")
    if pooling is None:
        raise ModelLoadError(f"'{path / 'modules.json'}' has no Pooling module")
    return EncoderPooling(pooling, normalize, _max_seq_length(module_dir))
