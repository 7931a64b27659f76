"""Tool-call parsers: a model's text -> OpenAI tool calls, whole (extract) or streamed (feed/finish).

Pure Python over plain strings and dicts; nothing here knows the engine or the server.

    parser = tool_parser("hermes", request_tools)
    parser.extract(text) -> ExtractedToolCalls(tools_called, tool_calls, content)
    parser.feed(delta) -> [{"content": ...} | {"tool_calls": [...]}]; parser.finish() at the end

Formats: hermes.py, llama.py, mistral.py, pythonic.py, qwen3_xml.py; the shared streaming machine
and its guarantees (split-invariance, linear time, the content whitespace rule, malformed calls):
base.py; canonical JSON arguments: json_stream.py.
"""

from .base import ExtractedToolCalls, ToolCall, ToolParser, make_tool_call_id
from .hermes import HermesToolParser
from .llama import Llama3JsonToolParser
from .mistral import MistralToolParser
from .pythonic import PythonicToolParser
from .qwen3_xml import Qwen3XmlToolParser

__all__ = ["TOOL_PARSERS", "tool_parser", "ToolParser", "ToolCall", "ExtractedToolCalls",
           "make_tool_call_id"]

# vLLM's --tool-call-parser names (llama4_json and qwen3_coder are vLLM's aliases of the same formats)
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
    "qwen3_xml": Qwen3XmlToolParser,
    "qwen3_coder": Qwen3XmlToolParser,
}


def tool_parser(name: str, tools: list[dict] | None = None) -> ToolParser:
    """A fresh parser (one per request: it holds streaming state) for the OpenAI tools list."""
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool parser {name!r}; choose from {', '.join(sorted(TOOL_PARSERS))}")
    return cls(tools)
