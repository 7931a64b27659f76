"""JSON that strict parsers read (JavaScript's JSON.parse, Go, serde, orjson), for what the
model's text becomes on the wire.

The model's text is valid Unicode (the tokenizer decodes bytes with replacement), but decoding
the JSON or Python escapes in it is not: `"\\ud800"` is a lone surrogate, which has no UTF-8
form (orjson refuses to write it; json.dumps(ensure_ascii=False) writes text that cannot be
encoded), and `NaN`, `Infinity` or `1e999` read as floats that JSON has no number for. So:

- a lone surrogate becomes U+FFFD, the replacement character, as a UTF-8 decoder does with a
  byte it cannot read; two surrogates that form a pair (Python keeps `"\\ud83d\\ude00"` from
  ast.literal_eval as two code points) become the one character they encode; in JSON text
  passed on as the model wrote it, a lone surrogate's escape becomes `\\ufffd`;
- NaN and the infinities become null, as JavaScript's JSON.stringify (and orjson) write them.

vLLM answers a lone surrogate with a 500 (or an error event mid-stream) and writes NaN as is;
docs/serving.md says what we do instead. Each check is one C-speed scan on the common path."""

from __future__ import annotations

import json
import math
import re

import orjson

__all__ = ["valid_unicode", "valid_escapes", "json_text", "json_bytes"]

_SURROGATE = re.compile("[\ud800-\udfff]")
# a \u escape of a surrogate, a high one with the low one after it if there is one; not
# preceded by an odd number of backslashes (then its backslash is itself escaped)
_SURROGATE_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)(\\u[dD][89abAB][0-9a-fA-F]{2}"
                               r"(?:\\u[dD][c-fC-F][0-9a-fA-F]{2})?|\\u[dD][c-fC-F][0-9a-fA-F]{2})")


def valid_unicode(text: str) -> str:
    """text with surrogate pairs joined and lone surrogates replaced by U+FFFD."""
    if _SURROGATE.search(text) is None:
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def valid_escapes(text: str) -> str:
    """JSON text (a forced call's arguments, as the grammar let the model write them) with each
    \\u escape of a lone surrogate written \\ufffd; pairs stay as they are."""
    if "\\u" not in text:
        return text
    return _SURROGATE_ESCAPE.sub(_escape_replaced, text)


def _escape_replaced(match: re.Match) -> str:
    if len(match[2]) == 12:  # a pair
        return match[0]
    return match[1] + "\\ufffd"


def json_text(value) -> str:
    """json.dumps(value, ensure_ascii=False) as strict parsers read it (a tool call's
    arguments): non-finite numbers null, text valid Unicode."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except ValueError:  # a NaN or an infinity somewhere in it
        text = json.dumps(_finite_and_valid(value), ensure_ascii=False)
    return valid_unicode(text)


def json_bytes(obj) -> bytes:
    """orjson.dumps(obj) for a response that carries model text; where a lone surrogate got into
    it (orjson refuses those: the caller would answer 500 or leave its stream unfinished) the
    text is made valid first."""
    try:
        return orjson.dumps(obj)
    except TypeError as exc:
        if "surrogates" not in str(exc):
            raise
    return orjson.dumps(_finite_and_valid(obj))


def _finite_and_valid(value):
    """A copy of a JSON-shaped value with every string (and key) valid Unicode and every
    non-finite float None; iterative, so any depth json.loads or literal_eval produced is fine."""
    root = [value]
    pending = [(root, 0)]
    while pending:
        holder, key = pending.pop()
        item = holder[key]
        if isinstance(item, str):
            holder[key] = valid_unicode(item)
        elif isinstance(item, float):
            if not math.isfinite(item):
                holder[key] = None
        elif isinstance(item, dict):
            copy = {valid_unicode(k) if isinstance(k, str) else k: v for k, v in item.items()}
            holder[key] = copy
            pending.extend((copy, k) for k in copy)
        elif isinstance(item, (list, tuple)):
            copy = list(item)
            holder[key] = copy
            pending.extend((copy, i) for i in range(len(copy)))
    return root[0]
