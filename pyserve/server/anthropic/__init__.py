"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) as a
translation onto the chat path: request.py makes the chat body, OpenAIServing.chat_result
answers it, response.py makes Anthropic's message or events of the answer, serving.py holds
the routes. Errors come in Anthropic's shape."""

from pyserve.server.anthropic.serving import AnthropicServing

__all__ = ["AnthropicServing"]
