"""Reasoning parsers on hand-recorded DeepSeek-R1 and Qwen3 outputs: extract() against the
expected split, streaming against extract() for every split point, random splits and
1-character deltas, reasoning_ended() along the way, and time bounds on adversarial outputs."""

import random
import time

import pytest

from pyserve.server.openai.reasoning import REASONING_PARSERS, reasoning_parser

# (id, parser, options, model output, reasoning, content)
CASES = [
    ("r1-template-opened-think", "deepseek_r1", {},
     "Okay, the user asks for 2+2. Adding: 2+2 = 4.\n</think>\n\nThe answer is **4**.",
     "Okay, the user asks for 2+2. Adding: 2+2 = 4.\n", "\n\nThe answer is **4**."),
    ("r1-explicit-think-unicode", "deepseek_r1", {},
     "<think>\nHmm, déjà vu: 日本語 and emoji 🤔 — careful with <b> tags.\n</think>\n\nAnswer: はい.",
     "\nHmm, déjà vu: 日本語 and emoji 🤔 — careful with <b> tags.\n", "\n\nAnswer: はい."),
    ("r1-leading-whitespace-then-think", "deepseek_r1", {}, "\n <think>x</think>y", "x", "y"),
    ("r1-truncated", "deepseek_r1", {}, "Let me think about <this> and </thin",
     "Let me think about <this> and </thin", None),
    ("r1-empty-reasoning", "deepseek_r1", {}, "</think>Hello", None, "Hello"),
    ("r1-later-tags-are-content", "deepseek_r1", {}, "a</think>b<think>c</think>d", "a",
     "b<think>c</think>d"),
    ("r1-whitespace-only", "deepseek_r1", {}, "  \n", "  \n", None),
    ("r1-empty", "deepseek_r1", {}, "", None, None),
    ("r1-thinking-disabled", "deepseek_r1", {"enable_thinking": False}, "<think>x</think>y", None,
     "<think>x</think>y"),
    ("qwen3-thinking", "qwen3", {},
     "<think>\nThe user wants the capital of France. It is Paris.\n</think>\n\nParis is the capital of France.",
     "\nThe user wants the capital of France. It is Paris.\n", "\n\nParis is the capital of France."),
    ("qwen3-enable-thinking-false", "qwen3", {}, "Paris is the capital of France.", None,
     "Paris is the capital of France."),
    ("qwen3-unfinished", "qwen3", {}, "<think>\nStill thinking about </thi",
     "\nStill thinking about </thi", None),
    ("qwen3-empty-think-block", "qwen3", {}, "<think>\n\n</think>\n\nHello", "\n\n", "\n\nHello"),
    ("qwen3-end-without-start", "qwen3", {}, "Plain </think> text", None, "Plain </think> text"),
    ("qwen3-leading-whitespace", "qwen3", {}, "\n\n<think>r</think>c", "r", "c"),
    ("qwen3-think-only-at-start", "qwen3", {}, "Hi <think>r</think>", None, "Hi <think>r</think>"),
    ("qwen3-partial-start-is-content", "qwen3", {}, "  <thin", None, "  <thin"),
    ("qwen3-template-opened-think", "qwen3", {"starts_in_reasoning": True},
     "Thinking 2507 style.\n</think>\n\nDone.", "Thinking 2507 style.\n", "\n\nDone."),
]


def stream(name, options, pieces):
    p = reasoning_parser(name, **options)
    frags = []
    for piece in pieces:
        frags += p.feed(piece)
    return frags + p.finish()


def joined(frags):
    for f in frags:
        assert len(f) == 1 and set(f) <= {"reasoning", "content"} and next(iter(f.values())), f
    return ("".join(f.get("reasoning", "") for f in frags), "".join(f.get("content", "") for f in frags))


def check_stream(name, options, text, pieces):
    reasoning, content = reasoning_parser(name, **options).extract(text)
    assert joined(stream(name, options, pieces)) == (reasoning or "", content or ""), pieces


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_extract_recorded_outputs(case):
    _, name, options, text, reasoning, content = case
    assert reasoning_parser(name, **options).extract(text) == (reasoning, content)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_stream_every_split_and_random_splits(case):
    _, name, options, text, _, _ = case
    for cut in range(len(text) + 1):
        check_stream(name, options, text, [text[:cut], text[cut:]])
    check_stream(name, options, text, list(text))
    rng = random.Random(len(text))
    for _ in range(30):
        if len(text) > 2:
            cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 10))))
            check_stream(name, options, text, [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_reasoning_ended_tracks_the_stream(case):
    _, name, options, text, _, _ = case
    p = reasoning_parser(name, **options)
    for k, ch in enumerate(text, 1):
        p.feed(ch)
        assert p.ended == p.reasoning_ended(text[:k]), text[:k]
    reasoning, _ = reasoning_parser(name, **options).extract(text)
    if "</think>" in text and reasoning is not None:
        assert p.reasoning_ended(text) and p.ended


def test_markers_split_across_deltas_are_held_back():
    p = reasoning_parser("deepseek_r1")
    assert p.feed("abc</th") == [{"reasoning": "abc"}]
    assert p.feed("ink>\n\nhi") == [{"content": "\n\nhi"}]
    p = reasoning_parser("qwen3")
    assert p.feed("\n<th") == []
    assert p.feed("ink>r") == [{"reasoning": "r"}]
    p = reasoning_parser("qwen3")
    assert p.feed("<th") == []
    assert p.feed("e answer") == [{"content": "<the answer"}]
    assert not reasoning_parser("deepseek_r1").reasoning_ended("still thinking")
    assert reasoning_parser("deepseek_r1").reasoning_ended("x</think>")
    assert reasoning_parser("qwen3", enable_thinking=False).reasoning_ended("")


def test_registry():
    assert set(REASONING_PARSERS) >= {"deepseek_r1", "qwen3"}
    assert reasoning_parser("qwen3").start == "<think>" and reasoning_parser("qwen3").end == "</think>"
    with pytest.raises(ValueError, match="deepseek_r1.*qwen3"):
        reasoning_parser("nope")


N = 100_000
ADVERSARIAL = ["<think>" * (N // 7), "</" * (N // 2), "<" * N, " " * N, "<think>" + "</thin" * (N // 6),
               " " * (N // 2) + "<thin" * (N // 10)]


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("index", range(len(ADVERSARIAL)))
def test_adversarial_outputs_in_linear_time(name, index):
    text = ADVERSARIAL[index]
    t = time.perf_counter()
    reasoning_parser(name).extract(text)
    assert time.perf_counter() - t < 1.0
    p = reasoning_parser(name)
    t = time.perf_counter()
    for ch in text[:20_000]:
        p.feed(ch)
    p.finish()
    assert time.perf_counter() - t < 2.0
