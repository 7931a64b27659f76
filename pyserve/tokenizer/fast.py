"""A model's tokenizer served by the `tokenizers` library alone.

Importing transformers costs the server about a second of its start-up, yet for most models
transformers' tokenizer is `tokenizer.json` plus a few names from `tokenizer_config.json`.
FastTokenizer is used only for a directory where that holds (`load_fast_tokenizer` checks
every setting with which transformers would change the backend or its output, and returns
None otherwise); it encodes, decodes and renders plain chat templates exactly as transformers
does. Anything else a caller asks of it (another method, tools in a chat template) loads the
transformers tokenizer on first use and hands the call to it."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from pyserve.tokenizer import chat_template as templates

GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                       "mask_token")
# tokenizer_config.json keys with which transformers rewrites the backend's post-processor or
# its special tokens, or splits special tokens when encoding: present at all -> transformers.
_REWRITING_KEYS = ("add_bos_token", "add_eos_token", "additional_special_tokens",
                   "extra_special_tokens", "split_special_tokens", "add_prefix_space")
# apply_chat_template arguments only transformers handles
# Texts (and id lists) at least this long are handed to the backend's batch calls, which let
# go of Python's global lock while they work: its single-text encode and decode keep it, so a
# 2 MB prompt tokenized in a worker thread froze the event loop for seconds.
RELEASE_LOCK_LENGTH = 4096
_TRANSFORMERS_ONLY_ARGS = ("tools", "documents", "continue_final_message", "padding", "truncation",
                           "max_length", "return_tensors", "return_assistant_tokens_mask",
                           "tokenizer_kwargs", "sanitize_control_tokens")


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # a serialized AddedToken
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_template(path: Path, config: dict) -> tuple[bool, str | None]:
    """(usable, template): transformers prefers chat_template.jinja to the config's entry;
    named templates (a list, or additional_chat_templates/) are left to it."""
    if (path / "additional_chat_templates").exists():
        return False, None
    jinja_file = path / "chat_template.jinja"
    if jinja_file.exists():
        return True, jinja_file.read_text(encoding="utf-8")
    if (path / "chat_template.json").exists():  # a processor's file: which one wins is transformers' call
        return False, None
    template = config.get("chat_template")
    return template is None or isinstance(template, str), template


def load_fast_tokenizer(path: Path) -> FastTokenizer | None:
    """The FastTokenizer of directory `path`, or None where transformers would load something
    that behaves differently (then transformers must load it)."""
    try:
        config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("tokenizer_class") not in GENERIC_CLASSES:
        return None
    if any(key in config for key in _REWRITING_KEYS) or config.get("clean_up_tokenization_spaces"):
        return None
    # any other *_token entry becomes a model-specific special token in transformers 5
    if any(k.endswith("_token") and k not in SPECIAL_TOKEN_NAMES for k in config):
        return None
    usable, template = _read_template(path, config)
    if not usable or not (path / "tokenizer.json").exists():
        return None
    from tokenizers import Tokenizer

    try:
        backend = Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception:  # an unreadable file: transformers will say what is wrong with it
        return None
    if backend.truncation is not None or backend.padding is not None:
        return None
    added = backend.get_added_tokens_decoder()
    for token_id, token in (config.get("added_tokens_decoder") or {}).items():
        if _token_text(token) is None or backend.token_to_id(_token_text(token)) != int(token_id):
            return None  # transformers would add it to the backend
    special = {}
    for name in SPECIAL_TOKEN_NAMES:
        if config.get(name) is None:
            continue
        text = _token_text(config[name])
        token_id = backend.token_to_id(text) if text is not None else None
        if token_id is None or not getattr(added.get(token_id), "special", False):
            return None  # transformers would add or re-mark it as a special token
        special[name] = text
    return FastTokenizer(path, backend, special, template)


class FastTokenizer:
    def __init__(self, path: Path, backend, special_tokens: dict[str, str], template: str | None):
        self.name_or_path = str(path)
        self._tokenizer = backend
        self.special_tokens_map = special_tokens
        self.chat_template = template
        self._transformers = None
        self._transformers_lock = threading.Lock()
        for name in SPECIAL_TOKEN_NAMES:
            text = special_tokens.get(name)
            setattr(self, name, text)
            setattr(self, f"{name}_id", None if text is None else backend.token_to_id(text))

    @property
    def backend_tokenizer(self):
        return self._tokenizer

    @property
    def all_special_ids(self) -> list[int]:
        ids = [getattr(self, f"{name}_id") for name in SPECIAL_TOKEN_NAMES]
        return list(dict.fromkeys(i for i in ids if i is not None))

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys(self.special_tokens_map[n] for n in SPECIAL_TOKEN_NAMES
                                  if n in self.special_tokens_map))

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs) -> list[int]:
        if kwargs:
            return self.transformers_tokenizer().encode(text, add_special_tokens=add_special_tokens,
                                                        **kwargs)
        return self._encode_ids(text, add_special_tokens)

    def _encode_ids(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) < RELEASE_LOCK_LENGTH:
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        # the same ids; _fast: without the character offsets nobody here reads
        return self._tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids, skip_special_tokens: bool = False, **kwargs) -> str:
        if kwargs.get("clean_up_tokenization_spaces"):
            return self.transformers_tokenizer().decode(token_ids, skip_special_tokens, **kwargs)
        token_ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        if len(token_ids) < RELEASE_LOCK_LENGTH:
            return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self._tokenizer.decode_batch([token_ids], skip_special_tokens=skip_special_tokens)[0]

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self._tokenizer.token_to_id(tokens)
        return [self._tokenizer.token_to_id(t) for t in tokens]

    def apply_chat_template(self, conversation, chat_template: str | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True,
                            return_dict: bool = True, **kwargs):
        """transformers' apply_chat_template for one conversation of plain messages; anything
        else is handed to transformers."""
        if not self.renders_chat_itself(conversation, chat_template, kwargs):
            return self.transformers_tokenizer().apply_chat_template(
                conversation, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                tokenize=tokenize, return_dict=return_dict, **kwargs)
        template = chat_template if chat_template is not None else self.chat_template
        messages = self._plain_messages(conversation)
        if template is None:
            raise ValueError("this tokenizer has no chat template; pass chat_template")
        for name in _TRANSFORMERS_ONLY_ARGS:
            kwargs.pop(name, None)  # present but empty: as if absent
        text = templates.render(template, messages, add_generation_prompt,
                                {**self.special_tokens_map, **kwargs})
        if not tokenize:
            return text
        ids = self._encode_ids(text, add_special_tokens=False)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids

    def renders_chat_itself(self, conversation, chat_template: str | None, kwargs: dict) -> bool:
        """Whether apply_chat_template renders this itself (within pyserve's template budget)
        rather than handing it to transformers."""
        template = chat_template if chat_template is not None else self.chat_template
        return (self._plain_messages(conversation) is not None
                and not any(kwargs.get(a) for a in _TRANSFORMERS_ONLY_ARGS)
                and templates.is_plain_data(kwargs)
                and not (template is not None and templates.needs_transformers(template)))

    @staticmethod
    def _plain_messages(conversation) -> list[dict] | None:
        """The messages with None-valued fields dropped, as transformers does; None when the
        conversation needs transformers' own preparation (objects, reasoning fields, batches)."""
        if not isinstance(conversation, list) or not conversation:
            return None
        messages = []
        for message in conversation:
            if type(message) is not dict or not templates.is_plain_data(message):
                return None
            if any(message.get(f) is not None for f in templates.REASONING_FIELDS):
                return None
            messages.append({k: v for k, v in message.items() if v is not None})
        return messages

    def transformers_tokenizer(self):
        """The transformers tokenizer of the same directory, loaded on first use."""
        with self._transformers_lock:
            if self._transformers is None:
                from pyserve.tokenizer.tokenizer import load_transformers_tokenizer

                self._transformers = load_transformers_tokenizer(Path(self.name_or_path))
            return self._transformers

    def __call__(self, *args, **kwargs):
        # dunder lookups skip __getattr__: calling the tokenizer is transformers' business
        return self.transformers_tokenizer()(*args, **kwargs)

    def __getattr__(self, name: str):
        # only reached for what FastTokenizer does not define itself
        if name.startswith("__") or name in ("_transformers", "_transformers_lock", "_tokenizer"):
            raise AttributeError(name)
        return getattr(self.transformers_tokenizer(), name)
