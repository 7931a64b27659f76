"""Incremental detokenization with the default model's byte-level BPE: non-ASCII text split
across tokens never comes out broken, deltas add up to the final text, and stop strings never
leak into streamed text."""

import pytest

from pyserve.tokenizer.detokenizer import IncrementalDetokenizer
from pyserve.tokenizer.tokenizer import load_tokenizer

TEXTS = ["Héllo wörld, ça va? 日本語のテキスト 🎉🚀 emoji, Ελληνικά, русский текст.",
         "naïve café — “quotes” and ‘more’ … 数学 ∑∫√ done"]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_add_up_and_never_break_characters(tokenizer, text):
    prompt = tokenizer.encode("Translate: ")
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True)
    deltas = []
    for i in ids:
        detok.add_token(i)
        deltas.append(detok.new_text(finished=False))
    deltas.append(detok.new_text(finished=True))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text


def test_stop_string_is_held_back_and_never_streamed(tokenizer):
    text = "The answer is 42. STOP here and nothing more."
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [], True, stop_strings=("STOP",))
    streamed, stop = "", None
    for i in ids:
        stop = detok.add_token(i)
        streamed += detok.new_text(finished=stop is not None)
        if stop:
            break
    assert stop == "STOP"
    assert streamed == "The answer is 42. " and "STOP" not in streamed


def test_special_tokens_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("Hi") + [tokenizer.eos_token_id]
    skip = IncrementalDetokenizer(tokenizer, [], True)
    keep = IncrementalDetokenizer(tokenizer, [], False)
    for i in ids:
        skip.add_token(i)
        keep.add_token(i)
    assert skip.text == "Hi"
    assert keep.text == "Hi" + tokenizer.eos_token
