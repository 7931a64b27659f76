"""Incremental detokenization with the default model's byte-level BPE: non-ASCII text split
across tokens never comes out broken, deltas add up to the final text, and stop strings never
leak into streamed text."""

import json

import pytest

from pyserve.tokenizer.detokenizer import IncrementalDetokenizer
from pyserve.tokenizer.tokenizer import load_tokenizer, load_transformers_tokenizer

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


def test_sentencepiece_style_tokenizer(tmp_path):
    """A Metaspace (SentencePiece-style, '▁' for spaces, byte fallback) tokenizer: streamed
    deltas, including the first output token's leading space, add up to the full decode."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", *bytes_])
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 20, TEXTS[0]], trainer)
    # byte-fallback pieces are ordinary tokens in SentencePiece vocabularies, not special ones
    spec = json.loads(tok.to_str())
    for added in spec["added_tokens"]:
        added["special"] = added["content"] in ("<unk>", "<s>", "</s>")
    tok = Tokenizer.from_str(json.dumps(spec))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    for text in ["the lazy dog jumps", TEXTS[0], "ümlaut ✓ the fox"]:
        prompt = fast.encode("the quick")
        ids = fast.encode(text)
        detok = IncrementalDetokenizer(fast, prompt, skip_special_tokens=True)
        out = ""
        for i in ids:
            detok.add_token(i)
            piece = detok.new_text(finished=False)
            assert "\ufffd" not in piece
            out += piece
        out += detok.new_text(finished=True)
        # in context after the prompt, the first piece keeps its leading space
        assert out.strip() == fast.decode(ids).strip() == text


def test_generic_tokenizer_loads_directly_and_matches_autotokenizer(default_model_dir):
    """load_transformers_tokenizer skips AutoTokenizer's config resolution for the generic
    tokenizer classes; what it returns must behave as AutoTokenizer's would."""
    from transformers import AutoTokenizer

    ours = load_transformers_tokenizer(default_model_dir)
    theirs = AutoTokenizer.from_pretrained(str(default_model_dir))
    assert type(ours) is type(theirs)
    for text in ["Hello world", "<|im_start|>user\nhi<|im_end|>", " leading space", "ünïcödé 🙂"]:
        assert ours.encode(text) == theirs.encode(text)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert (ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    assert (ours.eos_token_id, ours.bos_token_id, ours.all_special_ids) == \
        (theirs.eos_token_id, theirs.bos_token_id, theirs.all_special_ids)
