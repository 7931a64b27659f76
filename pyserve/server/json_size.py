"""How many JSON containers (objects and arrays) a request body holds, counted before it is
parsed: orjson builds every one of them without letting go of Python's global lock, so a
32 MB body of 900,000 small objects held the event loop for a second or more even when
parsed in a worker thread (and as long again to free). A body past MAX_JSON_CONTAINERS is
refused unparsed.

Counting brackets in the raw bytes (C speed) settles almost every body: a body cannot hold
more containers than it has `{` and `[`. Only a body with more brackets than the cap (text
full of code, or a hostile body) is counted exactly, outside its strings, by regular
expressions matched piece by piece from Python (the event loop gets the lock between them)."""

from __future__ import annotations

import re

from pyserve.server.errors import APIError
from pyserve.server.request_limits import MAX_JSON_CONTAINERS, MAX_JSON_DEPTH

# Outside strings, one match is a run of plain bytes and short strings (at most 4,096 of them),
# a bracket, or the start of a long string (up to 64 pieces of text or escapes); inside a long
# string, its next 64 pieces. Each match is one bounded C call, and there are few of them: a
# bracket ends a run, and the count stops at the cap. (Character classes with bounded repeats,
# not an alternation per character: C regex speed.)
_STRING_TEXT = rb'(?:[^"\\]{1,65536}|\\.){0,64}'
_SHORT_STRING = rb'"[^"\\]{0,256}(?:\\.[^"\\]{0,256}){0,4}"'
_OUTSIDE = re.compile(rb'(?:[^"\[\]{}\\]{1,65536}|' + _SHORT_STRING + rb'){1,4096}'
                      rb'|(?P<open>[\[{])|(?P<close>[\]}])'
                      rb'|(?P<long>"' + _STRING_TEXT + rb')(?P<closed>")?', re.DOTALL)
_INSIDE = re.compile(_STRING_TEXT + rb'(?P<closed>")?', re.DOTALL)
# the key a run of the root object's members ends with (`..., "messages": `)
_LAST_KEY = re.compile(rb'"((?:[^"\\]|\\.){0,256})"\s*:\s*\Z')


class _Count:
    """Containers counted per member of the root object (the field a refusal names)."""

    def __init__(self):
        self.total, self.by_field, self.field = 0, {}, None

    def add(self) -> None:
        self.total += 1
        self.by_field[self.field] = self.by_field.get(self.field, 0) + 1

    def largest_field(self) -> str | None:
        return max(self.by_field, key=self.by_field.get) if self.by_field else None


def count_containers(raw: bytes, stop_after: int) -> _Count:
    """The objects and arrays in raw (JSON), outside its strings, counted up to stop_after + 1
    (what is not JSON is counted as far as it reads as JSON: the parse reports it); a 400 for
    nesting deeper than MAX_JSON_DEPTH on the way."""
    count, depth, position, inside, last_run = _Count(), 0, 0, False, b""
    while position < len(raw):
        match = (_INSIDE if inside else _OUTSIDE).match(raw, position)
        if match is None or match.end() == position:
            break
        position = match.end()
        if inside or match["long"] is not None:  # in a long string until its quote
            inside = match["closed"] is None
        elif match["open"] is not None:
            if depth == 1:  # a member of the root object: which one
                key = _LAST_KEY.search(last_run)
                count.field = key[1].decode("utf-8", "replace") if key else None
            depth += 1
            if depth > MAX_JSON_DEPTH:
                raise APIError(400, f"the request body nests more than {MAX_JSON_DEPTH} levels deep")
            count.add()
            if count.total > stop_after:
                break
        elif match["close"] is not None:
            depth -= 1
        elif depth == 1:
            last_run = match.group()
    return count


def check_container_count(raw: bytes) -> None:
    """A 400 for a body of more than MAX_JSON_CONTAINERS objects and arrays, before parsing,
    naming the member of the body that holds most of them."""
    if raw.count(b"{") + raw.count(b"[") <= MAX_JSON_CONTAINERS:
        return
    count = count_containers(raw, MAX_JSON_CONTAINERS)
    if count.total > MAX_JSON_CONTAINERS:
        field = count.largest_field()
        raise APIError(400, (f"'{field}' holds" if field else "the request body holds")
                       + f" more than {MAX_JSON_CONTAINERS:,} JSON objects and arrays (a body "
                       f"may hold at most {MAX_JSON_CONTAINERS:,})", field)
