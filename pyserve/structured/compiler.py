"""Grammars for structured outputs, compiled once per distinct request form.

A StructuredOutputsParams becomes an xgrammar CompiledGrammar: a JSON schema, the built-in
JSON grammar (json_object), a regex, a choice (an EBNF alternation of the literal strings), an
EBNF grammar or a structural tag. Compiled grammars live in an LRU bounded by entry count and
by their own memory size, keyed by a hash of the request's canonical form, so the tool schema
an agent sends on every turn compiles once. A spec too big to compile is refused before
anything runs (limits.py). Compilation is thread-safe and runs where the caller puts it (the
server: engine/grammar_lanes.py, a thread for small grammars, a killable process for big
ones, compile_process.py, whose results store() caches).

The tokenizer's vocabulary is read by xgrammar once, on the first grammar (a second or so
for a 50k vocabulary), so a server that never sees one never pays for it."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict

from pyserve.errors import InvalidRequest
from pyserve.sampling_params import StructuredOutputsParams
from pyserve.structured.limits import choice_count_limit, spec_size_limit

MAX_CACHED_GRAMMARS = 256
MAX_CACHED_BYTES = 256 * 1024**2


# --reasoning-parser -> the markers around a model's reasoning (a grammar starts after it)
REASONING_MARKERS = {"deepseek_r1": ("<think>", "</think>"), "qwen3": ("<think>", "</think>")}


def reasoning_markers(tokenizer, parser: str | None) -> tuple[int, int] | None:
    """The (start, end) token ids of the parser's markers, when each is one token."""
    if parser is None:
        return None
    ids = [tokenizer.encode(marker, add_special_tokens=False) for marker in REASONING_MARKERS[parser]]
    return (ids[0][0], ids[1][0]) if all(len(i) == 1 for i in ids) else None


class GrammarError(InvalidRequest):
    """The grammar cannot be compiled (an invalid schema, regex or grammar)."""


def canonical_text(spec: StructuredOutputsParams) -> str:
    """The spec as one JSON text (its cache key's source), held to limits.py's sizes: a
    GrammarError naming structured_outputs if it is too big to compile."""
    value = getattr(spec, spec.kind)
    # sized before the canonical text is written: a schema of megabytes is refused without
    # spending on it the second that sorting and writing it takes (on the event loop)
    why = (spec.kind == "choice" and choice_count_limit(value)) or spec_size_limit(spec.kind, value)
    if why:
        raise GrammarError("structured_outputs", why)
    if spec.kind == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise GrammarError("structured_outputs", f"the JSON schema is not valid JSON: {exc}") from None
    return json.dumps([spec.kind, value, spec.disable_any_whitespace, spec.disable_additional_properties],
                      sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def key_of(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def canonical_key(spec: StructuredOutputsParams) -> str:
    return key_of(canonical_text(spec))


def choice_grammar(choices: list[str]) -> str:
    """root ::= "a" | "b" ..., each choice an EBNF string literal."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _check_schema(schema) -> dict:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise GrammarError("structured_outputs", f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("structured_outputs", "a JSON schema must be an object")
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema if isinstance(schema, dict) else {}).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise GrammarError("structured_outputs", f"invalid JSON schema: {exc.message}") from None
    return schema


def compile_spec(compiler, spec: StructuredOutputsParams):
    """spec compiled by an xgrammar GrammarCompiler (this process's or a worker's); a
    GrammarError if it cannot be."""
    kind = spec.kind
    try:
        if kind == "json":
            schema = _check_schema(spec.json)
            if spec.disable_additional_properties and isinstance(schema, dict):
                schema = {"additionalProperties": False, **schema}
            return compiler.compile_json_schema(json.dumps(schema),
                                                any_whitespace=not spec.disable_any_whitespace)
        if kind == "json_object":  # an object, as vLLM (and OpenAI's JSON mode) mean it
            return compiler.compile_json_schema('{"type": "object"}',
                                                any_whitespace=not spec.disable_any_whitespace)
        if kind == "regex":
            return compiler.compile_regex(spec.regex)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(list(spec.choice)))
        if kind == "grammar":
            return compiler.compile_grammar(spec.grammar)
        return _structural_tag(compiler, spec.structural_tag)
    except GrammarError:
        raise
    except Exception as exc:  # xgrammar's parse and compile errors: the request's fault
        raise GrammarError("structured_outputs", f"cannot compile the {kind.replace('_', ' ')}: "
                           f"{str(exc).strip() or type(exc).__name__}") from None


def _structural_tag(compiler, text: str):
    import xgrammar as xgr

    tag = json.loads(text)
    if isinstance(tag, dict) and "structures" in tag:  # the older form vLLM also reads
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                 for s in tag["structures"]]
        return compiler.compile_structural_tag(items, tag["triggers"])
    return compiler.compile_structural_tag(text)


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...],
                 max_entries: int = MAX_CACHED_GRAMMARS, max_bytes: int = MAX_CACHED_BYTES):
        """tokenizer: a transformers tokenizer, or one with transformers_tokenizer() (pyserve's
        fast tokenizer); vocab_size: the model's (its logits' width, which may exceed the
        tokenizer's)."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._max_entries, self._max_bytes = max_entries, max_bytes
        self._compiler = None
        self._info = None  # xgrammar's TokenizerInfo, read with the compiler
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # the cache; xgrammar's compiler is thread-safe itself
        self._init_lock = threading.Lock()
        self.hits = self.misses = 0

    def _xgr_compiler(self):
        with self._init_lock:
            if self._compiler is None:
                import xgrammar as xgr

                hf = getattr(self._tokenizer, "transformers_tokenizer", None)
                hf = hf() if callable(hf) else self._tokenizer
                self._info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                                stop_token_ids=self._stop_token_ids)
                # its own cache off: ours below is bounded by count and bytes
                self._compiler = xgr.GrammarCompiler(self._info, max_threads=2, cache_enabled=False)
            return self._compiler

    def prepare(self) -> None:
        """Reads the vocabulary (once; a second or more for 50k tokens), so that the first
        compile's time is its own."""
        self._xgr_compiler()

    def tokenizer_info_json(self) -> str:
        """The vocabulary as xgrammar reads it, for a compiler in another process."""
        self._xgr_compiler()
        return self._info.serialize_json()

    def deserialize(self, text: str):
        """A CompiledGrammar that another process compiled (CompiledGrammar.serialize_json)."""
        import xgrammar as xgr

        self._xgr_compiler()
        return xgr.CompiledGrammar.deserialize_json(text, self._info)

    def cached(self, spec: StructuredOutputsParams, key: str | None = None):
        """The compiled grammar if it is cached, else None (no compilation)."""
        key = key or canonical_key(spec)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
            return compiled

    def compile(self, spec: StructuredOutputsParams):
        """The CompiledGrammar for spec, from the cache or compiled now (GrammarError if it
        cannot be)."""
        key = canonical_key(spec)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return compiled
            self.misses += 1
        compiled = compile_spec(self._xgr_compiler(), spec)
        self.store(key, compiled)
        return compiled

    def store(self, key: str, compiled) -> None:
        """Caches a grammar compiled elsewhere (or here), the least recently used out."""
        with self._lock:
            if key not in self._cache:
                self._cache[key] = compiled
                self._bytes += compiled.memory_size_bytes
            # the newest stays, however big: its request is admitted next and must find it
            while len(self._cache) > 1 and (len(self._cache) > self._max_entries
                                            or self._bytes > self._max_bytes):
                _, old = self._cache.popitem(last=False)
                self._bytes -= old.memory_size_bytes

    def matcher(self, compiled):
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self._cache), "bytes": self._bytes, "hits": self.hits,
                    "misses": self.misses}
