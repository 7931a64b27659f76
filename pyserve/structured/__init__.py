"""Structured outputs: grammars compiled with xgrammar (compiler.py), a matcher per request
that the engine advances with each accepted token and asks for the next token bitmask, and
the bitmask applied to the logits in the sampler (bitmask.py). A leaf: it imports nothing of
pyserve's layers, and xgrammar only when a grammar is first used."""
