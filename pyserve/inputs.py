"""vLLM's prompt types for the offline LLM: plain dicts, as LLM.generate reads them."""

from __future__ import annotations

from typing import TypedDict


class TextPrompt(TypedDict, total=False):
    prompt: str


class TokensPrompt(TypedDict, total=False):
    prompt_token_ids: list[int]
    prompt: str  # the text, when the caller has it (kept in RequestOutput.prompt)
