"""FastTokenizer (tokenizers alone, no transformers import) against transformers' own
tokenizer of the same directory: the same ids, text, special tokens and chat-template
renderings; directories where transformers would behave differently get transformers'."""

import json
import shutil
import subprocess
import sys

import pytest

from pyserve.tokenizer.fast import FastTokenizer, load_fast_tokenizer
from pyserve.tokenizer.tokenizer import load_tokenizer

TEXTS = ["Hello world", "<|im_start|>user\nhi<|im_end|>", " leading space", "ünïcödé 🙂 日本語",
         "", "a\n\n\tb  c", "<|endoftext|>x<repo_name>"]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "ünï 🙂 <|im_end|>"}],
    [{"role": "user", "content": "x", "name": None}],
]
# exercises namespace, loop controls, tojson of non-ASCII text, dict(), and template variables
CUSTOM_TEMPLATE = (
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'system' %}{% continue %}"
    "{% endif %}{% set ns.n = ns.n + 1 %}[{{ ns.n }}|{{ m.role }}] {{ m.content | tojson }}\n"
    "{% endfor %}{{ dict(a=1) | tojson }}{{ bos_token }}{{ greeting | default('none') }}"
    "{% if add_generation_prompt %}>>{% endif %}")


@pytest.fixture(scope="module")
def pair(default_model_dir):
    from transformers import AutoTokenizer

    return load_tokenizer(default_model_dir), AutoTokenizer.from_pretrained(str(default_model_dir))


def test_default_model_loads_without_importing_transformers(default_model_dir):
    code = ("import sys; from pathlib import Path; from pyserve.tokenizer.tokenizer import load_tokenizer; "
            f"t = load_tokenizer(Path({str(default_model_dir)!r})); "
            "print(type(t).__name__, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["FastTokenizer", "False"]


def test_encode_decode_and_special_tokens_match(pair):
    ours, theirs = pair
    assert isinstance(ours, FastTokenizer)
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == theirs.encode(text, add_special_tokens=special)
        ids = theirs.encode(text) + [theirs.eos_token_id]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
            assert (ours.convert_ids_to_tokens(ids, skip_special_tokens=skip)
                    == theirs.convert_ids_to_tokens(ids, skip_special_tokens=skip))
    assert ours.decode(ours.eos_token_id) == theirs.decode(theirs.eos_token_id)
    for name in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id", "eos_token",
                 "all_special_ids", "all_special_tokens", "vocab_size", "special_tokens_map",
                 "chat_template"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert len(ours) == len(theirs)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_chat_template_matches(pair, conversation):
    ours, theirs = pair
    for generation in (True, False):
        assert (ours.apply_chat_template(conversation, add_generation_prompt=generation, tokenize=False)
                == theirs.apply_chat_template(conversation, add_generation_prompt=generation, tokenize=False))
        assert (ours.apply_chat_template(conversation, add_generation_prompt=generation, return_dict=False)
                == theirs.apply_chat_template(conversation, add_generation_prompt=generation, return_dict=False))
        assert (ours.apply_chat_template(conversation, add_generation_prompt=generation)
                == dict(theirs.apply_chat_template(conversation, add_generation_prompt=generation)))


def test_custom_template_and_variables_match(pair):
    ours, theirs = pair
    conversation = CONVERSATIONS[1]
    for extra in ({}, {"greeting": "héllo"}):
        assert (ours.apply_chat_template(conversation, chat_template=CUSTOM_TEMPLATE, tokenize=False,
                                         add_generation_prompt=True, **extra)
                == theirs.apply_chat_template(conversation, chat_template=CUSTOM_TEMPLATE, tokenize=False,
                                              add_generation_prompt=True, **extra))


def test_tools_are_handed_to_transformers(pair):
    ours, theirs = pair
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}]
    template = "{% for t in tools %}{{ t.function.name }}{% endfor %}|{{ messages[0].content }}"
    assert (ours.apply_chat_template(CONVERSATIONS[0], tools=tools, chat_template=template, tokenize=False)
            == theirs.apply_chat_template(CONVERSATIONS[0], tools=tools, chat_template=template,
                                          tokenize=False) == "f|hi")
    assert ours.batch_decode([[1, 2]]) == theirs.batch_decode([[1, 2]])  # any other method
    assert ours("Hello world")["input_ids"] == theirs("Hello world")["input_ids"]  # and calling it


@pytest.mark.parametrize("template", ["{{ ''.__class__.__mro__ }}", "{{ messages.__class__.__base__ }}",
                                      "{% set ns = namespace(_x=1) %}", "{{ raise_exception('no') }}"])
def test_templates_run_sandboxed(pair, template):
    import jinja2

    ours, _ = pair
    with pytest.raises(jinja2.exceptions.TemplateError):
        ours.apply_chat_template(CONVERSATIONS[0], chat_template=template, tokenize=False)


def _copy(src, dst, **config_changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config.update(config_changes)
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("change", [
    {"add_bos_token": True},  # transformers rewrites the post-processor
    {"add_bos_token": False},
    {"clean_up_tokenization_spaces": True},
    {"tokenizer_class": "LlamaTokenizer"},
    {"image_token": "<|im_start|>"},  # a model-specific special token
    {"eos_token": "Hello"},  # an ordinary token named special: transformers re-marks it
    {"added_tokens_decoder": {"49152": {"content": "<new>", "special": True}}},
    {"chat_template": [{"name": "default", "template": "x"}]},
])
def test_directories_transformers_would_change_get_transformers(default_model_dir, tmp_path, change):
    path = _copy(default_model_dir, tmp_path / "tok", **change)
    (path / "model.safetensors").unlink()
    if "chat_template" in change:  # the .jinja file would take precedence, as in transformers
        (path / "chat_template.jinja").unlink()
    assert load_fast_tokenizer(path) is None
    if change.get("tokenizer_class") != "LlamaTokenizer":
        assert not isinstance(load_tokenizer(path), FastTokenizer)


def test_backend_truncation_gets_transformers(default_model_dir, tmp_path):
    path = _copy(default_model_dir, tmp_path / "tok")
    spec = json.loads((path / "tokenizer.json").read_text())
    spec["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    (path / "tokenizer.json").write_text(json.dumps(spec))
    assert load_fast_tokenizer(path) is None
