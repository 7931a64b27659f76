"""The Hugging Face fast tokenizer of a model, and its chat template."""

from __future__ import annotations

from pathlib import Path

from pyserve.model.errors import ModelLoadError


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # transformers raises many kinds here
        raise ModelLoadError(f"cannot load the tokenizer from '{path}': {exc}") from None


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                        chat_template: str | None = None, **template_kwargs) -> list[int]:
    """Renders in transformers' sandboxed Jinja environment and tokenizes."""
    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise ValueError("this model's tokenizer has no chat template; send a plain prompt")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        tokenize=True, chat_template=chat_template,
                                        **template_kwargs)
    if hasattr(ids, "keys") and "input_ids" in ids:  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
