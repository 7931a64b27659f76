"""Caps on what one request may ask for, in one place, so that a hostile value is refused (a 400
naming its field) before it costs time or memory in proportion to its size.

vLLM has none of these beyond pydantic's types (its n, stop, logit_bias and prompt lists are
unbounded); OpenAI's own API documents some (2048 embedding inputs, logit_bias in [-100, 100]).
Each cap is far above what a real client sends:

    MAX_JSON_DEPTH      nesting of a body (and of JSON carried in strings: schemas, tool-call
                        arguments, structural tags): the readers, chat templates and grammar
                        compilers below recurse, and Python's stack is 1,000 frames
    MAX_NUMBER_TEXT     characters of a number sent as a string ("0.7", "42"): int() of a long
                        digit string is quadratic (and refused past 4,300 digits)
    MAX_N               completions per prompt
    MAX_PROMPTS         prompts in one completions request, inputs in one embeddings request
    MAX_STOP            stop strings, stop_token_ids, stop_sequences (each list)
    MAX_STOP_CHARS      characters of one stop string: every step scans that much text
    MAX_LOGIT_BIAS      logit_bias entries
    MAX_MESSAGES        messages (or Responses input items) in one conversation
    MAX_CONTENT_PARTS   content parts (Anthropic content blocks, Responses parts) over all
                        messages of one conversation, counted before any is read
    MAX_TOOL_CALLS      tool calls over all messages of one conversation, counted before any
                        call's arguments are parsed
    MAX_TOOLS           tools offered in one request
    MAX_DOCUMENTS       documents handed to a chat template
    MAX_JSON_CONTAINERS objects and arrays in one request body, counted before it is parsed
                        (json_size.py): parsing holds Python's lock for each of them
"""

MAX_JSON_DEPTH = 64
MAX_NUMBER_TEXT = 64
MAX_N = 128
MAX_PROMPTS = 2048
MAX_STOP = 64
MAX_STOP_CHARS = 1024
MAX_LOGIT_BIAS = 2048
MAX_MESSAGES = 10_000
MAX_CONTENT_PARTS = 10_000
MAX_TOOL_CALLS = 10_000
MAX_TOOLS = 1024
MAX_DOCUMENTS = 1024
MAX_JSON_CONTAINERS = 100_000
