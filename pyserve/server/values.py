"""JSON values read as typed request fields, shared by every route (OpenAI's, Anthropic's,
Responses, embeddings): a 400 naming the field for anything else, decided in time and memory
bounded by the caps in server/request_limits.py, never by the size of the bad value.

Types are read as vLLM's pydantic models read them in lax mode: an integral float or a string
of digits is an int, "true"/"false" is a bool, and ints are floats. On top of pydantic: a
float must be finite (NaN and infinities, which JSON cannot carry but strings can, are
refused), an int must fit 64 bits, and a bool is never an int (Python's True is one)."""

from __future__ import annotations

import heapq
import logging
import math
import re
from typing import Any

from pyserve.server.errors import APIError
from pyserve.server.request_limits import MAX_JSON_DEPTH, MAX_NUMBER_TEXT

logger = logging.getLogger("pyserve")

_INT64 = (-2**63, 2**63 - 1)
_INT_TEXT = re.compile(r"\s*[+-]?[0-9]+\s*", re.ASCII)  # the spaces int() strips: not \x1c-\x1f
_TRUE, _FALSE = ("true", "t", "yes", "y", "on", "1"), ("false", "f", "no", "n", "off", "0")
_SHOWN = 40  # characters of a refused string quoted in an error


def brief(value: Any) -> str:
    """A refused value as an error shows it: short, and without walking a nested value (whose
    repr would recurse as deep as it nests)."""
    if isinstance(value, str):
        return repr(value) if len(value) <= _SHOWN else repr(value[:_SHOWN]) + f"... ({len(value)} characters)"
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, (int, float)):
        text = repr(value)
        return text if len(text) <= _SHOWN else f"an integer of {len(text)} digits"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def one_of(name: str, value: Any, allowed) -> None:
    """A value outside a fixed set is a 400 in pydantic's words for it, which vLLM's answer
    carries (its request models type such fields as Literals): clients and dashboards look for
    "literal_error" and the value, and the message lists what is allowed."""
    if value in allowed:
        return
    quoted = [repr(a) for a in allowed]
    expected = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
    raise APIError(400, f"{name}: Input should be {expected} [type=literal_error, "
                   f"input_value={brief(value)}]", name)


def is_int_text(text: str) -> bool:
    """Whether text is an integer written out ("42", " -7"), of a length int() reads at once."""
    return len(text) <= MAX_NUMBER_TEXT and _INT_TEXT.fullmatch(text) is not None


def _number_text(name: str, value: str, kind: str) -> str:
    if len(value) > MAX_NUMBER_TEXT:
        raise APIError(400, f"'{name}' must be {kind}, got {brief(value)}", name)
    return value


def as_int(name: str, value: Any) -> int:
    if isinstance(value, float):
        if not math.isfinite(value):
            raise APIError(400, f"'{name}' must be an integer, got {brief(value)}", name)
        if abs(value) >= 2**63:
            # the JSON parser reads an integer beyond 64 bits as a float (-2**63 - 1 rounds to
            # -2**63): an integer's range cannot be trusted through it
            raise APIError(400, f"'{name}' is out of the 64-bit integer range", name)
        if value.is_integer():
            value = int(value)
    elif isinstance(value, str) and _INT_TEXT.fullmatch(_number_text(name, value, "an integer")):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError(400, f"'{name}' must be an integer, got {brief(value)}", name)
    if not _INT64[0] <= value <= _INT64[1]:
        raise APIError(400, f"'{name}' is out of the 64-bit integer range", name)
    return value


def as_float(name: str, value: Any) -> float:
    if isinstance(value, str):
        try:
            value = float(_number_text(name, value, "a number"))
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise APIError(400, f"'{name}' must be a number, got {brief(value)}", name)
    try:
        value = float(value)
    except OverflowError:  # an int past a double's range
        value = math.inf
    if not math.isfinite(value):
        raise APIError(400, f"'{name}' must be a finite number, got {brief(value)}", name)
    return value


def as_bool(name: str, value: Any) -> bool:
    if isinstance(value, str) and len(value) <= MAX_NUMBER_TEXT \
            and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
        return bool(value)
    if not isinstance(value, bool):
        raise APIError(400, f"'{name}' must be a boolean, got {brief(value)}", name)
    return value


def field(body: dict, name: str, kinds, default: Any = None) -> Any:
    """body[name] read as kinds (a type or a tuple of types); absent or null gives default."""
    value = body.get(name)
    if value is None:
        return default
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if kinds == (int,):
        return as_int(name, value)
    if kinds == (float,):
        return as_float(name, value)
    if kinds == (bool,):
        return as_bool(name, value)
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise APIError(400, f"'{name}' has the wrong type", name)
    return value


def capped(name: str, values, cap: int, what: str = "entries") -> None:
    """A 400 when a list (or object) holds more than cap items."""
    if len(values) > cap:
        raise APIError(400, f"{name} may hold at most {cap} {what}, got {len(values)}", name)


def token_ids(where: str, ids: list, vocab_size: int, param: str | None = None) -> list[int]:
    """ids if it is a list of token ids in [0, vocab_size); else a 400 naming the first bad
    entry (`where` is its path, e.g. "prompt[2]"; param the field, where's head by default).
    Each entry must be a JSON integer: not a float (1.0), not a bool (Python's True is 1)."""
    param = param or where.split("[", 1)[0]
    for i, t in enumerate(ids):
        if type(t) is not int:  # bool is a subclass of int, not int itself
            raise APIError(400, f"{where}[{i}] must be a token id (an integer), got {brief(t)}",
                           param)
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):  # C loops: no Python loop for the common case
        i, bad = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size)
        # vLLM's wording, which clients match on
        raise APIError(400, f"Token id {brief(bad)} at {where}[{i}] is out of vocabulary (token "
                       f"ids must lie in [0, {vocab_size}))", param)
    return ids


def nests_deeper(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether a parsed JSON value nests more than limit containers deep (the value itself is
    level 1): a depth-first walk without recursion, holding one iterator per open level (so
    its memory is bounded by limit, however wide the value)."""
    if not isinstance(value, (dict, list)):
        return False
    open_levels = [iter(value.values() if isinstance(value, dict) else value)]
    while open_levels:
        for child in open_levels[-1]:
            if isinstance(child, (dict, list)):
                if len(open_levels) >= limit:
                    return True
                open_levels.append(iter(child.values() if isinstance(child, dict) else child))
                break
        else:
            open_levels.pop()
    return False


def check_nesting(raw: bytes | str, value: Any, what: str, param: str | None) -> None:
    """A 400 when value (parsed from raw) nests more than MAX_JSON_DEPTH deep. Counting raw's
    brackets (C speed) settles almost every body without walking it: a value cannot nest deeper
    than it has brackets."""
    opening = (b"[", b"{") if isinstance(raw, bytes) else ("[", "{")
    if raw.count(opening[0]) + raw.count(opening[1]) <= MAX_JSON_DEPTH:
        return
    if nests_deeper(value):
        raise APIError(400, f"{what} nests more than {MAX_JSON_DEPTH} levels deep", param)


def log_ignored_fields(names) -> None:
    """vLLM's warning for request fields its request models do not know (they are accepted and
    ignored, so an SDK's newer fields do not break requests): one log line naming them, of
    bounded length however many a body holds."""
    if names:  # names are the client's: each shown at most 40 characters long
        shown = [n if len(n) <= 40 else n[:40] + "..." for n in heapq.nsmallest(20, names)]
        logger.warning("the following fields were present in the request but ignored: %s%s",
                       ", ".join(shown), f" and {len(names) - 20} more" if len(names) > 20 else "")
