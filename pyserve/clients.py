"""`pyserve chat` and `pyserve complete`: `vllm chat` / `vllm complete`, clients of a running
OpenAI-compatible server (pyserve's or any other) through the openai SDK.

Both print "Using model: NAME" (the first of /v1/models unless --model-name), then either send
one --quick message and print the streamed reply, or read one message a line from stdin until
EOF, streaming each reply to stdout. chat keeps the conversation (the system prompt, every
message and reply); complete sends each line as a prompt of its own. cli.py parses the flags
and resolves the API key (the environment is read only there)."""

from __future__ import annotations

import argparse
import sys
import time


def build_parser(kind: str, prog: str) -> argparse.ArgumentParser:
    what = "chat with" if kind == "chat" else "complete prompts on"
    parser = argparse.ArgumentParser(prog=prog, allow_abbrev=False,
                                     description=f"{what} a running OpenAI-compatible server")
    parser.add_argument("--url", default="http://localhost:8000/v1",
                        help="the server's API base URL (default: %(default)s)")
    parser.add_argument("--model-name", "--model", dest="model_name",
                        help="model to ask (default: the first of /v1/models)")
    parser.add_argument("--api-key", help="bearer token (default: $OPENAI_API_KEY)")
    if kind == "chat":
        parser.add_argument("--system-prompt", help="system message that opens the conversation")
    else:
        parser.add_argument("--max-tokens", type=int, help="most tokens per completion")
    parser.add_argument("-q", "--quick", metavar="MESSAGE" if kind == "chat" else "PROMPT",
                        help="send this one message, print the reply, and exit")
    parser.add_argument("--stats", action="store_true",
                        help="print time to first token and tokens per second after each reply")
    return parser


def run(kind: str, args: argparse.Namespace, api_key: str) -> int:
    import openai

    client = openai.OpenAI(api_key=api_key, base_url=args.url)
    try:
        model = args.model_name or _first_model(client)
        print(f"Using model: {model}")
        if kind == "chat":
            _chat(client, model, args)
        else:
            _complete(client, model, args)
    except KeyboardInterrupt:
        print()
    except (openai.APIConnectionError, openai.APIStatusError, LookupError) as exc:
        print(f"pyserve {kind}: {args.url}: {_describe(exc)}", file=sys.stderr)
        return 1
    return 0


def _first_model(client) -> str:
    models = client.models.list().data
    if not models:
        raise LookupError("the server lists no models; pass --model-name")
    return models[0].id


def _describe(exc: Exception) -> str:
    import openai

    if isinstance(exc, openai.APIStatusError):
        return f"HTTP {exc.status_code}: {exc.message}"
    if isinstance(exc, openai.APIConnectionError):
        return f"cannot reach the server ({exc.__cause__ or exc})"
    return str(exc)


def _lines(prompt: str):
    """The lines a user types (or pipes in), until EOF."""
    print(prompt)
    while True:
        try:
            yield input("> ")
        except EOFError:
            return


def _chat(client, model: str, args) -> None:
    conversation = []
    if args.system_prompt is not None:
        conversation.append({"role": "system", "content": args.system_prompt})
    kwargs = dict(model=model, stream=True)
    if args.stats:
        kwargs["stream_options"] = {"include_usage": True}
    messages = [args.quick] if args.quick else _lines("Please enter a message for the chat model:")
    for message in messages:
        conversation.append({"role": "user", "content": message})
        stream = client.chat.completions.create(messages=conversation, **kwargs)
        reply = _print_stream(stream, lambda choice: choice.delta.content, args.stats)
        conversation.append({"role": "assistant", "content": reply})


def _complete(client, model: str, args) -> None:
    kwargs = dict(model=model, stream=True)
    if args.max_tokens:
        kwargs["max_tokens"] = args.max_tokens
    if args.stats:
        kwargs["stream_options"] = {"include_usage": True}
    prompts = [args.quick] if args.quick else _lines("Please enter prompt to complete:")
    for prompt in prompts:
        stream = client.completions.create(prompt=prompt, **kwargs)
        _print_stream(stream, lambda choice: choice.text, args.stats)


def _print_stream(stream, text_of, stats: bool) -> str:
    """Prints each chunk's text as it comes, then a newline; returns the whole text."""
    parts = []
    start = time.perf_counter()
    first = None
    tokens = 0
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        text = text_of(chunk.choices[0]) if chunk.choices else None
        if text:
            first = first or time.perf_counter() - start
            parts.append(text)
            print(text, end="", flush=True)
    print()
    elapsed = time.perf_counter() - start
    if stats and first is not None and elapsed > 0:
        print(f"TTFT: {first * 1000:.2f} ms")
        print(f"TPS:  {tokens / elapsed:.2f} tokens/s ({tokens} tokens in {elapsed:.2f}s)")
    return "".join(parts)
