"""Errors that cross layers. Each carries what a user needs to act on it; the server maps them
to HTTP without reading their messages."""

from __future__ import annotations


class ModelLoadError(Exception):
    """The model cannot be used as given; the message says what to change."""


class InvalidRequest(ValueError):
    """A request the engine can never run. param names the request field at fault (OpenAI's
    `param`), or None when no single field is."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param
        self.message = message
