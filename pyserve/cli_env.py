"""The environment under the command line (cli.py): PYSERVE_<FLAG> for every flag, and the
vLLM variables that mean the same here (VLLM_API_KEY, VLLM_LOGGING_LEVEL,
VLLM_CPU_KVCACHE_SPACE, VLLM_ALLOW_LONG_MAX_MODEL_LEN). The command line wins, then
PYSERVE_*, then VLLM_*."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

ENV_PREFIX = "PYSERVE_"
_TRUE = ("1", "true", "yes", "on")


def apply_env_defaults(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """PYSERVE_<DEST> values become defaults, converted and checked like the flag itself (by
    the first flag of a dest: --kv-cache-memory's units, not --kv-cache-memory-bytes')."""
    seen = set()
    for action in parser._actions:
        if not action.option_strings or action.dest in seen or action.dest == "help":
            continue
        seen.add(action.dest)
        raw = environ.get(ENV_PREFIX + action.dest.upper())
        if raw is None:
            continue
        value = _env_value(parser, action, raw, f"{ENV_PREFIX}{action.dest.upper()} "
                           f"(for {action.option_strings[0]})")
        parser.set_defaults(**{action.dest: value})


def _env_value(parser: argparse.ArgumentParser, action: argparse.Action, raw: str, name: str):
    try:
        if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
            return raw.strip().lower() in _TRUE
        value = action.type(raw) if action.type else raw
        if action.choices is not None and value not in action.choices:
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(map(str, action.choices))}")
        return value
    except (ValueError, argparse.ArgumentTypeError) as exc:
        parser.error(f"{name}: invalid value '{raw}': {exc}")


def apply_vllm_env(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """vLLM's variables, below the flags and PYSERVE_* (VLLM_CPU_KVCACHE_SPACE: parse_serve)."""
    actions = {a.dest: a for a in parser._actions}
    for variable, dest in (("VLLM_API_KEY", "api_key"), ("VLLM_LOGGING_LEVEL", "log_level")):
        raw = environ.get(variable)
        if raw and parser.get_default(dest) is None:
            parser.set_defaults(**{dest: _env_value(parser, actions[dest], raw, variable)})


def _runs_on_cpu(device: str) -> bool:
    """Whether the engine will pick the CPU (engine/core.py's resolve_device, without loading
    the engine)."""
    if device != "auto":
        return device == "cpu"
    import torch

    from pyserve import _native

    return not (torch.cuda.is_available() and _native.built_with_cuda())


def cpu_kv_cache_space(parser, environ: Mapping[str, str], device: str) -> int | None:
    """VLLM_CPU_KVCACHE_SPACE, as vLLM reads it: whole GiB; 0 or unset: the default."""
    raw = environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        parser.error(f"VLLM_CPU_KVCACHE_SPACE: must be a whole number of GiB, got '{raw}'")
    gib = int(raw)
    return gib * 1024**3 if gib > 0 and _runs_on_cpu(device) else None


def fault_step_from_env(parser, environ: Mapping[str, str]) -> int | None:
    """$PYSERVE_TEST_FAULT_STEP (tests only): the model step at which the engine raises an
    injected fault (engine/faults.py); unset: none."""
    raw = environ.get(ENV_PREFIX + "TEST_FAULT_STEP", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        parser.error(f"{ENV_PREFIX}TEST_FAULT_STEP: must be a step number from 1, got '{raw}'")
    return int(raw)


def allow_long_max_model_len(environ: Mapping[str, str]) -> bool:
    """VLLM_ALLOW_LONG_MAX_MODEL_LEN: a --max-model-len beyond the model's trained length is
    taken (executor/plan.py warns)."""
    return environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "").strip().lower() in _TRUE
