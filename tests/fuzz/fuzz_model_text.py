"""atheris target: the model's text -> the JSON a response carries, through the real tool-call
parsers (server/openai/tool_parsers, every format, whole and streamed in fuzzer-chosen pieces),
the forced modes' reading (server/openai/chat_output.py) and the writers' last
guard (server/strict_json.py).

The text is built from the pieces that matter (each format's markers, JSON and Python
punctuation) and the shapes that found issue 68: escapes that decode to lone surrogates
(`\\ud800`), numbers JSON has not (`NaN`, `Infinity`, `1e999`), mixed with fuzzer Unicode. The
model's own text is valid Unicode (the detokenizer replaces bad bytes), so the raw text has no
surrogates; only decoding can make them.

Properties, per input: no parser raises; every streamed fragment and every whole result is
written by orjson (valid UTF-8: a lone surrogate there was a 500, or a stream that never
ended); every call's arguments are JSON that strict parsers read (no NaN or infinity, no lone
surrogate in any string: JavaScript and Go clients refuse those); a stream's calls are the
whole text's calls. And json_bytes writes any JSON-shaped value, surrogates and all, as
JSON orjson reads back.

    python -m tests.fuzz.fuzz_model_text -runs=100000 -seed=1 CORPUS_DIR
(tests/fuzz/test_atheris.py runs it briefly in CI.)"""

from __future__ import annotations

import json
import math
import re
import sys

import atheris
import orjson

with atheris.instrument_imports(include=["pyserve.server.openai.tool_parsers",
                                         "pyserve.server.openai.chat_output",
                                         "pyserve.server.strict_json"]):
    from pyserve.server.openai.chat_output import ChoiceOutput
    from pyserve.server.openai.tool_parsers import TOOL_PARSERS, tool_parser
    from pyserve.server.strict_json import json_bytes, json_text

FORMATS = sorted(set(TOOL_PARSERS) - {"llama4_json", "qwen3_coder"})  # those two are aliases
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "s": {"type": "string"}, "n": {"type": "number"}, "i": {"type": "integer"},
    "b": {"type": "boolean"}, "o": {"type": "object"}, "a": {"type": "array"}}}}},
    {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}]
PIECES = [
    # the formats' markers
    "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>",
    "<|python_start|>", "<|python_end|>", "<function=f>", "<function=", "<parameter=",
    "</parameter>", "</function>", ">", "\n",
    # JSON and Python structure
    '{"name": "f", "arguments": ', '{"name": "g", "parameters": ', '{"s": ', '"n": ', "{", "}",
    "[", "]", '"', ":", ",", " ", ";", "(", ")", "=", "'", "[f(", "s=", "n=", "o=", "f", "s", "n",
    "o", "a", "i", "b", "\\", "\\n", "\\u", "\\u00e9",
    # what issue 68 found: escapes that decode to lone surrogates, numbers JSON has not
    "\\ud800", "\\udc00", "\\ud83d", "\\ude00", "\\ud83d\\ude00", "\\uDBFF\\uDFFF", "NaN",
    "Infinity", "-Infinity", "1e999", "-1e999", "1e-999", "1E400", "0", "-0", "1.5", "true",
    "null", "None", "True", "float('nan')", '"\\ud800"', "'\\ud800'", "'\\ud83d\\ude00'",
]
# a hostile call of each format (and of the "required" grammar's list), for the fuzzer to edit
CALLS = [
    '<tool_call>{"name": "f", "arguments": {"s": "a\\ud800b", "n": NaN, "o": {"x": Infinity},'
    ' "a": [1e999, -Infinity, "\\udc00\\ud83d\\ude00"]}}</tool_call>',
    '{"name": "f", "parameters": {"s": "\\ud83d", "n": -1e999}}; {"name": "g", "arguments": '
    '"{\\"n\\": NaN, \\"s\\": \\"\\\\ud800\\"}"}',
    '[TOOL_CALLS][{"name": "f", "arguments": {"s": "\\ud83d\\ude00\\ud800", "n": NaN}}]',
    '[TOOL_CALLS]f[ARGS]{"n": Infinity, "s": "\\udbff"}[TOOL_CALLS]g{"o": [NaN]}',
    "[f(s='\\ud800', n=1e999, o={'a': -1e999, 'b': '\\ud83d\\ude00'}, a=[1e400]), g()]",
    "<|python_start|>[g(s='\\udc00')]<|python_end|>",
    "<tool_call>\n<function=f>\n<parameter=n>\nNaN\n</parameter>\n<parameter=o>\n"
    '{"x": "\\ud800", "y": Infinity}\n</parameter>\n<parameter=a>\n[1e999, \'\\ud800\']\n'
    "</parameter>\n<parameter=i>\n1e999\n</parameter>\n</function>\n</tool_call>",
    '[{"name": "f", "parameters": {"s": "\\ud800", "n": 1e999}}, {"name": "g", "parameters": {}}]',
]
_SURROGATE = re.compile("[\ud800-\udfff]")


def model_text(fdp) -> str:
    """One of CALLS (or nothing) with fuzzer edits: pieces and Unicode put in, spans cut out."""
    text = CALLS[fdp.ConsumeIntInRange(0, len(CALLS) - 1)] if fdp.ConsumeIntInRange(0, 7) else ""
    for _ in range(fdp.ConsumeIntInRange(0, 12)):
        at, edit = fdp.ConsumeIntInRange(0, len(text)), fdp.ConsumeIntInRange(0, 5)
        if edit == 0:
            text = text[:at] + text[at + fdp.ConsumeIntInRange(1, 8):]
        elif edit == 1:
            text = text[:at] + fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(1, 6)) + text[at:]
        else:
            text = text[:at] + PIECES[fdp.ConsumeIntInRange(0, len(PIECES) - 1)] + text[at:]
    return text


def pieces(fdp, text: str) -> list[str]:
    cuts = sorted({fdp.ConsumeIntInRange(0, len(text)) for _ in range(fdp.ConsumeIntInRange(0, 8))})
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


class NotStrict(AssertionError):
    pass


def _constant(name: str):
    raise NotStrict(f"{name} in arguments")


def check_strict(arguments: str, as_written: bool = False) -> None:
    """Arguments are JSON that strict parsers read. as_written: a named call's, the model's text
    as the grammar let it write it (JSON with no NaN: here, any text), of which only its lone
    surrogates are made valid."""
    try:
        value = json.loads(arguments, parse_constant=(lambda name: None) if as_written else _constant)
    except ValueError:
        if as_written:
            return
        raise
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, float):
            assert as_written or math.isfinite(item), (arguments, item)
        elif isinstance(item, str):
            assert _SURROGATE.search(item) is None, ascii(arguments)
        elif isinstance(item, dict):
            assert not any(_SURROGATE.search(k) for k in item), ascii(arguments)
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)


def check_parser(fmt: str, text: str, split: list[str]) -> None:
    whole = tool_parser(fmt, TOOLS).extract(text)
    orjson.dumps({"content": whole.content, "calls": [(c.name, c.arguments) for c in whole.tool_calls]})
    for call in whole.tool_calls:
        check_strict(call.arguments)
    parser, calls = tool_parser(fmt, TOOLS), {}
    for fragments in [parser.feed(piece) for piece in split] + [parser.finish()]:
        for fragment in fragments:
            orjson.dumps(fragment)
            for call in fragment.get("tool_calls") or []:
                entry = calls.setdefault(call["index"], ["", ""])
                entry[0] += call["function"].get("name") or ""
                entry[1] += call["function"].get("arguments") or ""
    if whole.tools_called:
        assert [tuple(calls[i]) for i in sorted(calls)] == \
            [(c.name, c.arguments) for c in whole.tool_calls], (ascii(text), calls)


def check_forced(text: str) -> None:
    """tool_choice "required" (the grammar's list of {"name", "parameters"}, as json.loads reads
    it) and a named function (the grammar's arguments, passed on as written)."""
    for mode in ("required", "named"):
        fields = ChoiceOutput(mode, forced_name="f").whole(text)
        orjson.dumps(fields)
        for call in fields["tool_calls"]:
            check_strict(call["function"]["arguments"], as_written=mode == "named")


def check_writer(fdp) -> None:
    """json_bytes (every response that carries model text) writes surrogates and all."""
    strings = [fdp.ConsumeUnicode(fdp.ConsumeIntInRange(0, 6)) for _ in range(3)]
    value = {strings[0]: [strings[1], {"k": strings[2]}, fdp.ConsumeFloat()]}
    assert orjson.loads(json_bytes(value)) is not None
    check_strict(json_text(value))


def one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    fmt = FORMATS[fdp.ConsumeIntInRange(0, len(FORMATS) - 1)]
    text = model_text(fdp)
    check_parser(fmt, text, pieces(fdp, text))
    check_forced(text)
    check_writer(fdp)


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
