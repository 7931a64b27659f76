"""The OpenAI Responses API on the chat path: translate.py (request -> chat body, items ->
messages), output.py (chat answer -> response object and stream events), store.py (the
server's stored responses), background.py (background: true, its runs and their events),
api.py (the routes)."""

from pyserve.server.openai.responses.api import ResponsesAPI
from pyserve.server.openai.responses.store import MAX_ENTRIES, ResponseStore

__all__ = ["MAX_ENTRIES", "ResponsesAPI", "ResponseStore"]
