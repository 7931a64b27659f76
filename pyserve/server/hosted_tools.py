"""Hosted tools: the tools an API's own service runs for the model (OpenAI's web_search,
file_search, code_interpreter, computer use, image_generation, MCP; Anthropic's server tools
such as web_search_20250305 and its MCP toolsets). pyserve runs none of them.

As vLLM does, they are left out of the prompt rather than failing the request: the model is
shown the client's own tools alone. Clients send them whether or not they are wanted (Codex
puts web_search in every request), so a 400 would make such a client unusable. Each request
that had some is named in the server's log with the types left out. A tool_choice that forces
one stays a 400 naming it: the answer it asks for cannot be given."""

from __future__ import annotations

import logging

logger = logging.getLogger("pyserve.requests")

SHOWN_TYPES = 10  # tool types named in one log line (the client's strings, each cut short)
SHOWN_CHARS = 40


def log_left_out(request_id: str, kinds: list[str]) -> None:
    """One warning naming the request and the hosted tool types left out of its prompt."""
    if not kinds:
        return
    unique = list(dict.fromkeys(k if len(k) <= SHOWN_CHARS else k[:SHOWN_CHARS] + "..." for k in kinds))
    more = f" and {len(unique) - SHOWN_TYPES} more" if len(unique) > SHOWN_TYPES else ""
    logger.warning("request %s: hosted tools left out of the prompt (this server does not run "
                   "them): %s%s", request_id, ", ".join(unique[:SHOWN_TYPES]), more)


def forced_hosted_tool(kind: str, field: str) -> str:
    """The 400's message for a tool_choice that forces the hosted tool of type kind."""
    return (f"{field} forces the hosted tool {kind}, which this server does not run (hosted "
            "tools are left out of the prompt); let the model choose among the other tools, or "
            "name a function tool")
