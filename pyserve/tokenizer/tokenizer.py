"""The Hugging Face fast tokenizer of a model, and its chat template."""

from __future__ import annotations

import json
from pathlib import Path

from pyserve.errors import ModelLoadError
from pyserve.tokenizer.fast import GENERIC_CLASSES, load_fast_tokenizer



def _declared_class(path: Path) -> str | None:
    try:
        return json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def load_tokenizer(path: Path):
    """The tokenizers-only FastTokenizer where it behaves as transformers' tokenizer would
    (importing transformers is a second of start-up), otherwise transformers' tokenizer."""
    return load_fast_tokenizer(path) or load_transformers_tokenizer(path)


def load_transformers_tokenizer(path: Path):
    import transformers

    # The generic classes depend on nothing but the tokenizer files: loaded directly, because
    # AutoTokenizer first resolves the model's config class, whose import chain (transformers'
    # model-loading machinery, torch.distributed.tensor) costs seconds.
    declared = _declared_class(path)
    if declared in GENERIC_CLASSES and hasattr(transformers, declared):
        try:
            return getattr(transformers, declared).from_pretrained(str(path))
        except Exception:  # anything unusual: let AutoTokenizer decide (and report)
            pass
    try:
        return transformers.AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # transformers raises many kinds here
        raise ModelLoadError(f"cannot load the tokenizer from '{path}': {exc}") from None


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                        chat_template: str | None = None, add_special_tokens: bool = False,
                        **template_kwargs) -> list[int]:
    """Renders in transformers' sandboxed Jinja environment and tokenizes; the template writes
    the special tokens itself, so add_special_tokens (vLLM's chat default: off) adds them again."""
    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise ValueError("this model's tokenizer has no chat template: start the server with "
                         "--chat-template, or send a plain prompt to /v1/completions")
    renders_itself = getattr(tokenizer, "renders_chat_itself", None)
    if renders_itself is None or not renders_itself(messages, chat_template, template_kwargs):
        _check_budget_for_transformers(tokenizer, messages, add_generation_prompt, chat_template,
                                       template_kwargs)
    if add_special_tokens:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             tokenize=False, chat_template=chat_template,
                                             **template_kwargs)
        return list(tokenizer.encode(text, add_special_tokens=True))
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        tokenize=True, chat_template=chat_template,
                                        **template_kwargs)
    if hasattr(ids, "keys") and "input_ids" in ids:  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


# apply_chat_template arguments that are not template variables
_NOT_VARIABLES = ("tools", "documents", "continue_final_message")


def _check_budget_for_transformers(tokenizer, messages: list[dict], add_generation_prompt: bool,
                                   chat_template: str | None, template_kwargs: dict) -> None:
    """transformers' own render has no time or output budget: the same template is run in
    pyserve's budgeted sandbox first (chat_template.check_budget)."""
    from pyserve.tokenizer import chat_template as templates

    tools, documents = template_kwargs.get("tools"), template_kwargs.get("documents")
    try:  # the template transformers picks (a named "tool_use" one with tools)
        template = tokenizer.get_chat_template(chat_template, tools)
    except Exception:  # no usable template: transformers says so in its own words
        return
    variables = {**getattr(tokenizer, "special_tokens_map", {}),
                 **{k: v for k, v in template_kwargs.items() if k not in _NOT_VARIABLES}}
    templates.check_budget(template, messages, add_generation_prompt, variables, tools, documents)
