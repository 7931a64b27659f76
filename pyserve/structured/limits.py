"""How big a grammar request may be, checked before anything is compiled, and which lane its
compile takes.

A grammar's compile time grows faster than its size (with a 512-token vocabulary on one
core: 250 choices of 250 characters, 64 KB, in 1.6 s; 500 of them in 6.4 s; 100,000 short
choices in 35-90 s; a schema of 200 optional properties, 5.5 KB, in 4 s). A spec past
MAX_CHOICES or MAX_SPEC_CHARS is a 400 naming its field before anything runs. vLLM has no
such limits; 1,000 is OpenAI's cap on a structured-output schema's enum values.

Size alone cannot bound the time (a short schema of many optional properties is slow), so a
spec that may be slow (is_big: long text, many subschemas, a large repetition such as
"a{0,5000}") compiles in a worker process that is killed when no request waits for it any
more (engine/grammar_lanes.py), and never holds the threads that compile small grammars."""

from __future__ import annotations

import re

MAX_CHOICES = 1_000
MAX_SPEC_CHARS = 64 * 1024  # a schema's, regex's, grammar's or structural tag's text; choices in all
# a spec under all three compiles in milliseconds; past any, it may take seconds
SMALL_SPEC_CHARS = 4 * 1024
SMALL_SUBSCHEMAS = 32  # "{": each property, item or branch of a schema is an object
SMALL_REPEAT = 1_024

# a bounded repetition in a regex or EBNF ("{5000}", "{0,5000}"), or a JSON schema's bounds
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
# (a structural tag's schemas are JSON inside a JSON string: their quotes come escaped)
_SCHEMA_BOUND = re.compile(r'"(?:minItems|maxItems|minLength|maxLength|minProperties|maxProperties)\\?"'
                           r"\s*:\s*(\d+)")


_NAMES = {"json": "the JSON schema", "choice": "the choices", "structural_tag": "the structural tag"}


def spec_size_limit(kind: str, value) -> str | None:
    """Why a spec of this kind and value (text, or the choices or schema as data) is too big
    to compile, else None."""
    if isinstance(value, str):
        over = len(value) > MAX_SPEC_CHARS
    else:
        over = _json_size_over(value, MAX_SPEC_CHARS)
    if over:
        return (f"{_NAMES.get(kind, 'the ' + kind)}: more than {MAX_SPEC_CHARS:,} characters (as "
                "compact JSON), the most that can be compiled; send a smaller one")
    return None


def _json_size_over(value, budget: int) -> bool:
    """Whether value written as compact JSON would pass budget characters: a walk that
    stops as soon as it does, so a schema of megabytes costs what 64 KiB of it costs."""
    stack, size = [value], 0
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            size += 1 + len(item)  # braces, colons and commas
            for key, child in item.items():
                size += len(str(key)) + 2
                if size > budget:
                    return True
                stack.append(child)
        elif isinstance(item, (list, tuple)):
            size += 1 + len(item)
            if size > budget:
                return True
            stack.extend(item)
        else:  # a string's quotes, or a number's or literal's digits, at least one character
            size += len(item) + 2 if isinstance(item, str) else 1
        if size > budget:
            return True
    return False


def choice_count_limit(choices) -> str | None:
    """Checked before the choices are even serialized: the count alone refuses a huge list."""
    if len(choices) > MAX_CHOICES:
        return f"{len(choices):,} choices; at most {MAX_CHOICES:,} can be compiled; send fewer"
    return None


def is_big(text: str) -> bool:
    """Whether the spec (its canonical text) may take seconds to compile: then it compiles in
    the killable worker process rather than in a thread."""
    if len(text) > SMALL_SPEC_CHARS or text.count("{") > SMALL_SUBSCHEMAS:
        return True
    return any(len(n) > 6 or int(n) > SMALL_REPEAT for pattern in (_REPEAT, _SCHEMA_BOUND)
               for match in pattern.finditer(text) for n in match.groups() if n)
