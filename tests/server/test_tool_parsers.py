"""Tool-call parsers on hand-recorded model outputs of each format: extract() against the
expected calls, and the streaming contract against extract() for every split point, random
multi-splits and 1-character deltas; malformed calls; hold-back of partial markers; canonical
JSON against json; time bounds on 100 KB adversarial outputs."""

import json
import random
import re
import time

import orjson
import pytest

from pyserve.server.openai.tool_parsers import TOOL_PARSERS, tool_parser
from pyserve.server.openai.tool_parsers.json_stream import JsonStream, Malformed, canonical_json
from pyserve.server.strict_json import json_text

WEATHER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
            "hours": {"type": "array", "items": {"type": "integer"}}, "extra": {"type": "object"},
            "threshold": {"type": "number"}, "note": {"type": ["string", "null"]}}}}},
    {"type": "function", "function": {"name": "write_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}},
]

# (id, parser, tools, model output, [(name, arguments)], content)
CASES = [
    ("hermes-qwen2.5-parallel", "hermes", None,
     "I'll check the weather in both cities for you.\n"
     "<tool_call>\n"
     '{"name": "get_current_weather", "arguments": {"location": "San Francisco, CA", "unit": "fahrenheit"}}\n'
     "</tool_call>\n"
     "<tool_call>\n"
     '{"name": "get_current_weather", "arguments": {"location": "Tōkyō, 日本", "unit": "celsius"}}\n'
     "</tool_call>",
     [("get_current_weather", {"location": "San Francisco, CA", "unit": "fahrenheit"}),
      ("get_current_weather", {"location": "Tōkyō, 日本", "unit": "celsius"})],
     "I'll check the weather in both cities for you."),
    ("hermes-qwen3-nested-escapes", "hermes", None,
     '<tool_call>\n{"name": "search_docs", "arguments": {"query": "say \\"hi\\" \\\\ path\\nnext",'
     ' "limit": 5, "filters": {"lang": ["en", "de"], "safe": true, "min_score": 0.75, "since": null},'
     ' "emoji": "\\ud83d\\ude00 caf\\u00e9 \\u0001 ok", "slash": "a\\/b"}}\n</tool_call>',
     [("search_docs", {"query": 'say "hi" \\ path\nnext', "limit": 5,
                       "filters": {"lang": ["en", "de"], "safe": True, "min_score": 0.75, "since": None},
                       "emoji": "\U0001F600 café \x01 ok", "slash": "a/b"})],
     None),
    ("hermes-arguments-first-text-after", "hermes", None,
     '<tool_call>\n{"arguments": {"expression": "2 * (3 + 4)", "precision": 1.50E1},'
     ' "name": "calculator"}\n</tool_call>\n\nI am computing that now.',
     [("calculator", {"expression": "2 * (3 + 4)", "precision": 15.0})],
     "I am computing that now."),
    ("hermes-text-between-calls", "hermes", None,
     "Checking A first.\n\n<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n"
     "<tool_call>\n{\"name\": \"b\", \"arguments\": {\"k\": \"v\"}}\n</tool_call>\n  And now B:  \n"
     "<tool_call>\n{\"name\": \"c\", \"arguments\": {\"n\": [1]}}\n</tool_call>\n",
     [("a", {}), ("b", {"k": "v"}), ("c", {"n": [1]})], "Checking A first.\n\nAnd now B:"),
    ("hermes-unclosed-last-call", "hermes", None,
     'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {}}',
     [("get_time", {})], "Sure."),
    ("hermes-no-call", "hermes", None,
     "Use <b>bold</b> and a <tool> tag, or <tool_call without a bracket. 3 < 4.\n",
     [], "Use <b>bold</b> and a <tool> tag, or <tool_call without a bracket. 3 < 4.\n"),
    ("llama3.1-python-tag", "llama3_json", None,
     '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3, "units": "metric"}}',
     [("get_weather", {"city": "Paris", "days": 3, "units": "metric"})], None),
    ("llama3.1-two-calls", "llama3_json", None,
     '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}',
     [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "Europe/Paris"})], None),
    ("llama3.2-extra-keys-text-after", "llama3_json", None,
     '\n\n{"type": "function", "name": "lookup", "parameters": {"term": "naïve café", "limit": -2.5e3}}'
     "\nThe result follows.",
     [("lookup", {"term": "naïve café", "limit": -2500.0})], "The result follows."),
    ("llama-plain-text", "llama3_json", None,
     "The capital of France is Paris.", [], "The capital of France is Paris."),
    ("mistral-v0.3-list", "mistral", None,
     '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France",'
     ' "format": "celsius"}}, {"name": "get_current_time", "arguments": {"timezone": "CET"}}]',
     [("get_current_weather", {"location": "Paris, France", "format": "celsius"}),
      ("get_current_time", {"timezone": "CET"})], None),
    ("mistral-v11-args-token", "mistral", None,
     'Let me check both.[TOOL_CALLS]get_current_weather[ARGS]{"location": "Paris, France",'
     ' "format": "celsius"}[TOOL_CALLS]get_current_time[ARGS]{"timezone":"CET"}',
     [("get_current_weather", {"location": "Paris, France", "format": "celsius"}),
      ("get_current_time", {"timezone": "CET"})], "Let me check both."),
    ("mistral-v11-bare", "mistral", None,
     '[TOOL_CALLS]add{"a": 3.5, "b": 4}', [("add", {"a": 3.5, "b": 4})], None),
    ("mistral-call-id", "mistral", None,
     '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Zürich"}',
     [("get_weather", {"city": "Zürich"})], None),
    ("pythonic-nested", "pythonic", None,
     '[get_weather(city="San Francisco, CA", metric=True), search(query=\'what is (2+2), really?\','
     ' tags=["a,b", "c)d", \'e]f\'], opts={"depth": 2, "langs": ("en", "fr"), "nested": {"k": [1, [2, 3]]}},'
     " limit=-1, ratio=0.5, none=None)]",
     [("get_weather", {"city": "San Francisco, CA", "metric": True}),
      ("search", {"query": "what is (2+2), really?", "tags": ["a,b", "c)d", "e]f"],
                  "opts": {"depth": 2, "langs": ["en", "fr"], "nested": {"k": [1, [2, 3]]}},
                  "limit": -1, "ratio": 0.5, "none": None})], None),
    ("pythonic-multiline-triple-quotes", "pythonic", None,
     '[write_file(\n    path="src/main.py",\n    content="""def f(x):\n    return (x, [1, 2]), \'done\'\n""",\n)]',
     [("write_file", {"path": "src/main.py", "content": "def f(x):\n    return (x, [1, 2]), 'done'\n"})],
     None),
    ("pythonic-llama4-tags", "pythonic", None,
     r'<|python_start|>[get_time(tz="Asia/東京", escaped="tab\there \u00e9", empty="")]<|python_end|>',
     [("get_time", {"tz": "Asia/東京", "escaped": "tab\there é", "empty": ""})], None),
    ("qwen3-xml-typed", "qwen3_xml", WEATHER_TOOLS,
     "Let me look that up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
     "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
     "<parameter=hours>\n[9, 12, 18]\n</parameter>\n"
     '<parameter=extra>\n{"wind": true, "alerts": ["storm"]}\n</parameter>\n'
     "<parameter=threshold>\n0.5\n</parameter>\n<parameter=note>\nnull\n</parameter>\n</function>\n</tool_call>",
     [("get_weather", {"city": "São Paulo", "days": 3, "metric": True, "hours": [9, 12, 18],
                       "extra": {"wind": True, "alerts": ["storm"]}, "threshold": 0.5, "note": None})],
     "Let me look that up."),
    ("qwen3-xml-code-and-fallbacks", "qwen3_xml", WEATHER_TOOLS,
     "<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/a.py\n</parameter>\n<parameter=content>\n"
     'if a < b and b > c:\n    print("<tag> & \\\\ done </param")\n\n</parameter>\n</function>\n</tool_call>\n'
     "<tool_call>\n<function=get_weather>\n<parameter=city>\nNullarbor\n</parameter>\n"
     "<parameter=days>\nseven\n</parameter>\n<parameter=metric>\nmaybe\n</parameter>\n</function>\n</tool_call>",
     [("write_file", {"path": "src/a.py", "content": 'if a < b and b > c:\n    print("<tag> & \\\\ done </param")\n'}),
      ("get_weather", {"city": "Nullarbor", "days": "seven", "metric": "maybe"})], None),
    ("qwen3-xml-no-tools-all-strings", "qwen3_xml", None,
     "<tool_call>\n<function=run>\n<parameter=cmd>\nls -la\n</parameter>\n<parameter=count>\n2\n"
     "</parameter>\n</function>\n</tool_call>",
     [("run", {"cmd": "ls -la", "count": "2"})], None),
    ("qwen3-xml-bare-function-missing-ends", "qwen3_xml", WEATHER_TOOLS,
     "<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n2\n</function>\nDone.",
     [("get_weather", {"city": "Paris", "days": 2})], "Done."),
    ("qwen3-xml-stream-cut", "qwen3_xml", WEATHER_TOOLS,
     "<tool_call>\n<function=get_weather>\n<parameter=city>\nLyon", [("get_weather", {"city": "Lyon"})], None),
]

# (id, parser, output, whether it fails before its first header, so that a stream matches too)
MALFORMED = [
    ("hermes-not-json", "hermes", "Hi <tool_call>\nnot json at all\n</tool_call> bye", True),
    ("hermes-no-name", "hermes", '<tool_call>{"arguments": {}}</tool_call>', True),
    ("hermes-trailing-comma", "hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>', False),
    ("hermes-unfinished-json", "hermes", '<tool_call>{"name": "f", "arguments": {"a": "b', False),
    ("hermes-junk-before-end", "hermes", '<tool_call>{"name": "f", "arguments": {}}}</tool_call>', False),
    ("llama-json-answer", "llama3_json", '{"answer": 42, "unit": "km"}', True),
    ("llama-builtin-python", "llama3_json", '<|python_tag|>brave_search.call(query="x")', True),
    ("mistral-not-a-call", "mistral", "[TOOL_CALLS] not a call", True),
    ("mistral-empty-list", "mistral", "[TOOL_CALLS][]", True),
    ("mistral-bad-marker", "mistral", "[TOOL_CALLS]get_weather[ARG]{}", True),
    ("pythonic-list-of-numbers", "pythonic", "[1, 2, 3]", True),
    ("pythonic-markdown", "pythonic", "[Note] see [link](http://x) (3pm).", True),
    ("pythonic-positional", "pythonic", "[f(1, 2)]", False),
    ("pythonic-unclosed", "pythonic", "[f(x='abc", False),
    ("qwen3-xml-bad-tag", "qwen3_xml", "<tool_call>\n<functio=oops>\n</tool_call>", True),
    ("qwen3-xml-empty", "qwen3_xml", "<tool_call></tool_call>", True),
    ("qwen3-xml-name-newline", "qwen3_xml", "<tool_call>\n<function=get\n<parameter=x>", True),
]


def parser_for(name, tools=None):
    return tool_parser(name, tools)


def stream(name, tools, pieces):
    p = parser_for(name, tools)
    frags = []
    for piece in pieces:
        frags += p.feed(piece)
    return frags + p.finish()


def assemble(frags):
    """(content, [(id, name, arguments)]), checking each fragment's shape on the way."""
    content, calls = [], []
    for f in frags:
        assert len(f) == 1, f
        if "content" in f:
            assert isinstance(f["content"], str) and f["content"], f
            content.append(f["content"])
            continue
        (tc,) = f["tool_calls"]
        i = tc["index"]
        if "id" in tc:
            assert i == len(calls), f
            assert tc["type"] == "function" and tc["function"]["arguments"] == "", f
            assert re.fullmatch(r"call_[0-9a-f]{24}", tc["id"]), f
            calls.append([tc["id"], tc["function"]["name"], ""])
        else:
            assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}, f
            assert 0 <= i < len(calls) and tc["function"]["arguments"], f
            calls[i][2] += tc["function"]["arguments"]
    return "".join(content), [tuple(c) for c in calls]


def check_stream(name, tools, text, pieces):
    expected = parser_for(name, tools).extract(text)
    content, calls = assemble(stream(name, tools, pieces))
    assert content == (expected.content or ""), pieces
    assert [(n, a) for _, n, a in calls] == [(c.name, c.arguments) for c in expected.tool_calls], pieces
    assert len({i for i, _, _ in calls}) == len(calls)


def random_splits(text, rng, count):
    cuts = sorted(rng.sample(range(1, len(text)), min(count, len(text) - 1)))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_extract_recorded_outputs(case):
    _, name, tools, text, calls, content = case
    got = parser_for(name, tools).extract(text)
    assert got.tools_called == bool(calls)
    assert [c.name for c in got.tool_calls] == [n for n, _ in calls]
    for call, (_, args) in zip(got.tool_calls, calls):
        assert json.loads(call.arguments) == args
        assert call.arguments == json.dumps(args, ensure_ascii=False)  # the canonical form
        assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
    assert got.content == content


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_stream_every_split_point(case):
    _, name, tools, text, _, _ = case
    for cut in range(len(text) + 1):
        check_stream(name, tools, text, [text[:cut], text[cut:]])


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_stream_random_splits_and_single_characters(case):
    _, name, tools, text, _, _ = case
    rng = random.Random(hash(case[0]) & 0xFFFF)
    check_stream(name, tools, text, list(text))
    check_stream(name, tools, text, [text])
    for _ in range(30):
        check_stream(name, tools, text, random_splits(text, rng, rng.randint(2, 12)))


@pytest.mark.parametrize("case", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_calls_are_content(case):
    _, name, text, before_header = case
    got = parser_for(name).extract(text)
    assert (got.tools_called, got.tool_calls, got.content) == (False, [], text)
    for cut in range(len(text) + 1):
        content, calls = assemble(stream(name, None, [text[:cut], text[cut:]]))  # never raises
        if before_header:
            assert (content, calls) == (text, [])


def test_pythonic_never_evaluates(tmp_path):
    target = tmp_path / "pwned"
    text = f"[f(x=open({str(target)!r}, 'w'), y=__import__('os').system('touch {target}'))]"
    got = tool_parser("pythonic").extract(text)
    assert not got.tools_called and got.content == text
    stream("pythonic", None, list(text))
    assert not target.exists()


def test_partial_marker_held_back_then_released():
    p = tool_parser("hermes")
    assert p.feed("Hello <tool_") == [{"content": "Hello"}]
    assert p.feed("x> there") == [{"content": " <tool_x> there"}]
    p = tool_parser("hermes")
    assert p.feed("Hello <tool_") == [{"content": "Hello"}]
    out = p.feed('call>{"name": "f", "arguments": {"a": 1}}</tool_call>')
    assert "content" not in str(out)
    assert assemble(out)[1][0][1:] == ("f", '{"a": 1}')
    p = tool_parser("qwen3_xml")
    assert p.feed("x <func") == [{"content": "x"}]
    assert p.finish() == [{"content": " <func"}]
    p = tool_parser("mistral")
    assert p.feed("ok [TOOL") == [{"content": "ok"}]
    assert p.feed("S]") == [{"content": " [TOOLS]"}]


def test_arguments_stream_as_they_arrive():
    p = tool_parser("hermes")
    p.feed('<tool_call>{"name": "write", "arguments": {"text": "abc')
    out = p.feed("def")
    assert out == [{"tool_calls": [{"index": 0, "function": {"arguments": "def"}}]}]
    p = tool_parser("qwen3_xml", WEATHER_TOOLS)
    head = p.feed("<tool_call>\n<function=write_file>\n<parameter=content>\nline one\n")
    assert assemble(head)[1][0][1:] == ("write_file", '{"content": "line one')  # newline held


@pytest.mark.parametrize("obj,arguments", [
    ('{"name": "f", "arguments": "{\\"a\\":1}"}', '{"a": 1}'),  # JSON in a string: decoded
    ('{"name": "f", "arguments": "not json"}', '"not json"'),  # a plain string: the JSON string
    ('{"name": "f", "arguments": null}', "{}"),
    ('{"name": "f"}', "{}"),
    ('{"id": 7, "name": "f", "extra": [1, {"x": "}"}], "arguments": {"b": 2}}', '{"b": 2}'),
])
def test_call_object_argument_forms(obj, arguments):
    text = f"<tool_call>{obj}</tool_call>"
    (call,) = tool_parser("hermes").extract(text).tool_calls
    assert (call.name, call.arguments) == ("f", arguments)
    check_stream("hermes", None, text, list(text))


def test_registry_and_ids():
    assert {"hermes", "llama3_json", "mistral", "pythonic", "qwen3_xml"} <= set(TOOL_PARSERS)
    with pytest.raises(ValueError, match="hermes.*llama3_json.*mistral.*pythonic.*qwen3_xml"):
        tool_parser("nope")
    text = CASES[0][3]
    ids = [c.id for _ in range(20) for c in tool_parser("hermes").extract(text).tool_calls]
    assert len(set(ids)) == len(ids) == 40


def _random_json(rng, depth=0):
    kind = rng.randrange(7 if depth < 4 else 4)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.choice([0, -0, 7, -12345678901234567890, 3.25, -0.0, 1e-7, 2.5e300, 0.1])
    if kind in (2, 3):
        alphabet = 'ab "\\/\n\t\x00\x1f\x7fé日\U0001F600\u2028<>{}[],:'
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(8)))
    if kind in (4, 5):
        return {f"k{rng.randrange(50)}{rng.choice(['', 'é', ' '])}": _random_json(rng, depth + 1)
                for _ in range(rng.randrange(4))}
    return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]


def test_canonical_json_matches_json_dumps():
    rng = random.Random(5)
    for _ in range(400):
        value = _random_json(rng)
        raw = json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 0, 2]),
                         separators=rng.choice([None, (",", ":"), (" , ", " : ")]))
        want = json.dumps(json.loads(raw), ensure_ascii=False)
        js, out = JsonStream(), []
        pieces = random_splits(raw, rng, rng.randint(1, 10)) if len(raw) > 1 else [raw]
        for i, piece in enumerate(pieces):
            pos = js.feed(piece, 0, i == len(pieces) - 1)
            assert pos == len(piece) or js.done
            out.append(js.take())
        assert "".join(out) == want and canonical_json(raw) == want
    # where json.dumps writes what strict parsers refuse (a lone surrogate, NaN, Infinity), the
    # canonical form is strict: U+FFFD and null (server/strict_json.py)
    for raw in ['"\\ud83d\\ude00"', '"\\ud83d\\ud83d\\ude00"', '"\\ud83dx"', '"\\udc00"',
                '"\\ud83d\\n"', '"\\ud83d"', '-0', '1E5', '1e400', '-1e400', '0.10', '[NaN, -Infinity]',
                '{"a": [], "b": {}}', '"\\u0000\\u001F\\u007f\\u2028"']:
        want = json_text(json.loads(raw))
        assert canonical_json(raw) == want, raw
        orjson.loads(want)
        for cut in range(1, len(raw)):
            js = JsonStream()
            js.feed(raw[:cut], 0)
            js.feed(raw[cut:], 0, True)
            assert js.take() == want, (raw, cut)
    for bad in ['{"a" 1}', "[1,]", '{"a": 1,}', "01", "tru", '"\\x"', '"\\u12g4"', "[1 2]", "{'a': 1}"]:
        assert canonical_json(bad) is None, bad
    with pytest.raises(Malformed):
        JsonStream().feed("]", 0)


N = 100_000
ADVERSARIAL = [
    ("hermes", "<tool_call>" * (N // 11)),
    ("hermes", "<tool_call>" + "{" * N),
    ("hermes", '<tool_call>{"name": "f", "arguments": ' + "[" * N),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": "' + "\\u00e9" * (N // 6)),
    ("hermes", "<tool_" * (N // 6)),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call>' * (N // 50)),
    ("llama3_json", "{" * N),
    ("llama3_json", '{"name": "f", "parameters": "' + "a" * N),
    ("llama3_json", '{"name": "f", "parameters": {}}; ' * (N // 34)),
    ("llama3_json", '{"name": "f", "parameters": ' + "1" * N),
    ("mistral", "[TOOL_CALLS]" * (N // 12)),
    ("mistral", "[TOOL_CALLS][" + "{" * N),
    ("mistral", "[TOOL_CALLS]" + "f" * N),
    ("mistral", "[TOOL_CALLS]f[ARGS]{}" * (N // 21)),
    ("pythonic", "[" * N),
    ("pythonic", "[f(x=" + "[" * N),
    ("pythonic", "[f(x='" + "a" * N),
    ("pythonic", "[f(x=" + '"""' + '""' * (N // 2)),
    ("pythonic", "[" + "f(x=1), " * (N // 8) + "f()]"),
    ("pythonic", "[f(x=" + "1" * N + ")]"),
    ("qwen3_xml", "<tool_call>" * (N // 11)),
    ("qwen3_xml", "<tool_call><function=" + "a" * N),
    ("qwen3_xml", "<tool_call><function=f><parameter=x>" + "<" * N),
    ("qwen3_xml", "<tool_call><function=f><parameter=x>" + "</param" * (N // 8)),
    ("qwen3_xml", "<function=f></function>" * (N // 23)),
    ("qwen3_xml", "<tool_call><function=f>" + "<parameter=x>1" * (N // 14)),
]


@pytest.mark.parametrize("name,text", ADVERSARIAL, ids=[f"{n}-{i}" for i, (n, _) in enumerate(ADVERSARIAL)])
def test_adversarial_outputs_extract_in_linear_time(name, text):
    t = time.perf_counter()
    parser_for(name, WEATHER_TOOLS).extract(text)
    # a bound against quadratic blow-up (hours at N = 100,000), not a speed figure: linear work
    # takes about a second at worst on a loaded 2-core machine
    assert time.perf_counter() - t < 10.0


@pytest.mark.parametrize("index", [1, 4, 5, 8, 13, 16, 18, 19, 22, 23, 25])
def test_adversarial_outputs_stream_in_linear_time(index):
    name, text = ADVERSARIAL[index]
    p = parser_for(name, WEATHER_TOOLS)
    t = time.perf_counter()
    for ch in text[:20_000]:
        p.feed(ch)
    p.finish()
    assert time.perf_counter() - t < 20.0  # against quadratic blow-up, as above


def _text_piece(rng, avoid):
    alphabet = ["a", "b", " ", "\n", "<", ">", "[", "]", "{", "}", "(", "é", "日", "tool", "_call", "/",
                "TOOL", "CALLS", "function", "=", ";", '"']
    while True:
        s = "".join(rng.choice(alphabet) for _ in range(rng.randrange(12)))
        if not any(m in s for m in avoid):
            return s


def _generated(rng, fmt):
    """A random output in one format: (text, [(name, arguments)]), content around the calls."""
    calls = [(f"fn_{rng.randrange(100)}", {f"k{i}": _random_json(rng, 1) for i in range(rng.randrange(4))})
             for _ in range(rng.randint(1, 3))]
    if fmt == "hermes":
        parts = [_text_piece(rng, ["<tool_call>"])]
        for name, args in calls:
            obj = {"name": name, "arguments": args} if rng.random() < 0.7 else {"arguments": args, "name": name}
            parts += ["<tool_call>", rng.choice(["", "\n"]), json.dumps(obj, ensure_ascii=rng.random() < 0.5),
                      rng.choice(["", "\n"]), "</tool_call>", _text_piece(rng, ["<tool_call>"])]
    elif fmt == "llama3_json":
        objs = [json.dumps({"name": n, rng.choice(["parameters", "arguments"]): a}) for n, a in calls]
        parts = [rng.choice(["", "<|python_tag|>", "\n"]), "; ".join(objs),
                 rng.choice(["", "\nThe end."])]
    elif fmt == "mistral":
        parts = [_text_piece(rng, ["[TOOL_CALLS]"]), "[TOOL_CALLS]"]
        if rng.random() < 0.5:
            parts.append(json.dumps([{"name": n, "arguments": a} for n, a in calls]))
        else:
            parts += [f"{n}{rng.choice(['', '[ARGS]'])}{json.dumps(a)}[TOOL_CALLS]" for n, a in calls]
            parts[-1] = parts[-1][:-len("[TOOL_CALLS]")]
        parts.append(_text_piece(rng, ["[TOOL_CALLS]"]))
    elif fmt == "pythonic":
        body = ", ".join(f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in calls)
        parts = [rng.choice(["", " \n"]), f"[{body}]", rng.choice(["", " done."])]
    else:  # qwen3_xml without tools: string values
        parts = [_text_piece(rng, ["<tool_call>", "<function="])]
        calls = [(n, {k: _text_piece(rng, ["<"]) for k in a}) for n, a in calls]
        for name, args in calls:
            params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
            parts += [f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>",
                      _text_piece(rng, ["<tool_call>", "<function="])]
        calls = [(n, {k: None if v.lower() == "null" else v for k, v in a.items()}) for n, a in calls]
    return "".join(parts), calls


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral", "pythonic", "qwen3_xml"])
def test_generated_outputs_round_trip(fmt):
    rng = random.Random(fmt)
    for _ in range(60):
        text, calls = _generated(rng, fmt)
        got = tool_parser(fmt).extract(text)
        assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == calls, text
        assert all(c.arguments == json.dumps(json.loads(c.arguments), ensure_ascii=False)
                   for c in got.tool_calls)
        for pieces in [list(text), random_splits(text, rng, 3), random_splits(text, rng, 20)]:
            check_stream(fmt, None, text, pieces)


def test_qwen3_xml_a_python_literal_json_has_not_stays_a_string():
    """Found by tests/fuzz/fuzz_model_text.py: an array parameter whose text literal_eval reads
    as a list holding bytes raised TypeError out of the parser (a 500)."""
    text = "<function=f>\n<parameter=a>\n[1, b'x']\n</parameter>\n</function>"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "array"}}}}}]
    (call,) = tool_parser("qwen3_xml", tools).extract(text).tool_calls
    assert json.loads(call.arguments) == {"a": "[1, b'x']"}


NUMBERS = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "n": {"type": "number"}, "o": {"type": "object"}, "s": {"type": "string"}}}}}


@pytest.mark.parametrize("name,text,arguments", [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"n": NaN, "m": Infinity, "k": -1e999, '
               '"s": "\\ud800\\ud83d\\ude00\\udc00"}}</tool_call>',
     {"n": None, "m": None, "k": None, "s": "\ufffd\U0001f600\ufffd"}),
    ("llama3_json", '{"name": "f", "arguments": "{\\"n\\": NaN, \\"s\\": \\"\\\\ud800\\"}"}',
     {"n": None, "s": "\ufffd"}),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"n": -Infinity, "s": "x\\udbff"}', {"n": None, "s": "x\ufffd"}),
    ("pythonic", "[f(n=1e999, m=-1e999, s='\\ud83d\\ude00\\udc00', o={'a': [1e400]})]",
     {"n": None, "m": None, "s": "\U0001f600\ufffd", "o": {"a": [None]}}),
    ("qwen3_xml", "<function=f>\n<parameter=n>\nNaN\n</parameter>\n<parameter=o>\n"
                  '{"a": Infinity, "b": "\\ud800"}\n</parameter>\n</function>',
     {"n": None, "o": {"a": None, "b": "\ufffd"}}),
])
def test_arguments_are_json_strict_parsers_read(name, text, arguments):
    """Issue 68 items 1 and 7: NaN, Infinity and 1e999 were written as Python's json writes
    them (JavaScript and Go refuse them), and an escaped lone surrogate as a code point that
    has no UTF-8 (the response then failed); now null and U+FFFD, streamed the same."""
    (call,) = tool_parser(name, [NUMBERS]).extract(text).tool_calls
    assert orjson.loads(call.arguments) == arguments
    check_stream(name, [NUMBERS], text, list(text))
