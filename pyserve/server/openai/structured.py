"""Structured-output fields of a request, as vLLM 0.32 reads them, -> StructuredOutputsParams
and the name of the field it came from (for a 400's `param`):

    response_format     {"type": "text" | "json_object" | "json_schema" | "structural_tag"}
    structured_outputs  {json | regex | choice | grammar | json_object | structural_tag, and
                         disable_any_whitespace, disable_additional_properties, disable_fallback}
    guided_json, guided_regex, guided_choice, guided_grammar, structural_tag   (older aliases)
    guided_decoding_backend ("xgrammar" or "auto": the one backend here)

Forced tool calls (tool_choice "required" or a named function) become a JSON schema too: the
named tool's parameters, or a non-empty list of {"name", "parameters"} for any of the tools,
as vLLM builds them."""

from __future__ import annotations

import json

import orjson

from pyserve.errors import InvalidRequest
from pyserve.sampling_params import StructuredOutputsParams
from pyserve.server.errors import APIError
from pyserve.server.openai.messages import tool_function
from pyserve.server.values import brief, check_nesting

_ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
            "guided_grammar": "grammar", "structural_tag": "structural_tag"}
_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback")
_BACKENDS = ("", "auto", "xgrammar")
_DEFS = ("$defs", "definitions")  # where a JSON schema keeps the definitions "#/..." refers to


def _json_text(param: str, text: str, what: str):
    """JSON carried in a string (a schema, a structural tag), parsed here so that its nesting
    is held to a body's: the grammar compiler's parser recurses."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"{param}: the {what} is not valid JSON: {exc}", param) from None
    check_nesting(text, value, f"{param}: the {what}", param)
    return value


def _params(param: str, **values) -> StructuredOutputsParams:
    if isinstance(values.get("json"), str):
        values["json"] = _json_text(param, values["json"], "JSON schema")
    if isinstance(values.get("structural_tag"), str):
        _json_text(param, values["structural_tag"], "structural tag")
    try:
        return StructuredOutputsParams(**values)
    except InvalidRequest as exc:
        raise APIError(400, exc.message.replace("structured_outputs", param, 1), param) from None


def _from_response_format(value) -> StructuredOutputsParams | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise APIError(400, "response_format must be an object with a 'type'", "response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return _params("response_format", json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
        if schema is None:
            raise APIError(400, "response_format json_schema needs json_schema.schema", "response_format")
        return _params("response_format", json=schema)
    if kind == "structural_tag":
        return _params("response_format", structural_tag=json.dumps(value))
    raise APIError(400, f"response_format type {brief(kind)} is not one of text, json_object, "
                   "json_schema, structural_tag", "response_format")


def _from_object(value) -> StructuredOutputsParams:
    if not isinstance(value, dict):
        raise APIError(400, "structured_outputs must be an object", "structured_outputs")
    unknown = set(value) - set(StructuredOutputsParams.KINDS) - set(_OPTIONS) - {"whitespace_pattern"}
    if unknown:
        raise APIError(400, f"structured_outputs has unknown fields: {', '.join(sorted(unknown))}",
                       "structured_outputs")
    if value.get("whitespace_pattern") is not None:
        raise APIError(400, "structured_outputs.whitespace_pattern is not supported by the xgrammar "
                       "backend; use disable_any_whitespace", "structured_outputs")
    values = {k: value[k] for k in StructuredOutputsParams.KINDS if value.get(k) is not None}
    if isinstance(values.get("structural_tag"), (dict, list)):
        values["structural_tag"] = json.dumps(values["structural_tag"])
    for option in ("disable_any_whitespace", "disable_additional_properties"):
        if value.get(option) is not None:
            if not isinstance(value[option], bool):
                raise APIError(400, f"structured_outputs.{option} must be a boolean", "structured_outputs")
            values[option] = value[option]
    return _params("structured_outputs", **values)


def structured_outputs(body: dict) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field it came from; (None, None) without one."""
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in _BACKENDS:
        raise APIError(400, f"guided_decoding_backend {brief(backend)} is not available; pyserve uses "
                       "xgrammar", "guided_decoding_backend")
    if body.get("guided_whitespace_pattern") is not None:
        raise APIError(400, "guided_whitespace_pattern is not supported by the xgrammar backend",
                       "guided_whitespace_pattern")
    found: list[tuple[StructuredOutputsParams, str]] = []
    if body.get("response_format") is not None:
        spec = _from_response_format(body["response_format"])
        if spec is not None:
            found.append((spec, "response_format"))
    if body.get("structured_outputs") is not None:
        found.append((_from_object(body["structured_outputs"]), "structured_outputs"))
    for name, kind in _ALIASES.items():
        value = body.get(name)
        if value in (None, "", [], {}):  # empty is vLLM's own default: absent
            continue
        if kind == "structural_tag" and not isinstance(value, str):
            value = json.dumps(value)
        found.append((_params(name, **{kind: value}), name))
    if len(found) > 1:
        raise APIError(400, "only one structured-output constraint may be given; got "
                       + ", ".join(name for _, name in found), found[1][1])
    return found[0] if found else (None, None)


def _parameters(function: dict) -> dict:
    parameters = function.get("parameters")
    return parameters if isinstance(parameters, dict) and parameters else {"type": "object", "properties": {}}


def forced_tool_name(tool_choice) -> str | None:
    """The function a named tool_choice forces, else None."""
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        if tool_choice.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            raise APIError(400, "a named tool_choice is {\"type\": \"function\", \"function\": "
                           "{\"name\": ...}}", "tool_choice")
        return function["name"]
    return None


def tool_call_constraint(tools: list, tool_choice, parallel: bool = True) -> StructuredOutputsParams:
    """The grammar that makes the output a valid call: the named tool's arguments, or (for
    "required") a non-empty JSON list of {"name", "parameters"} over every tool, of one item
    where parallel_tool_calls is false (the list ends after the one call the answer keeps,
    where a model that repeats items would otherwise write on until max_tokens cut it)."""
    functions = [tool_function(t, i) for i, t in enumerate(tools)]
    name = forced_tool_name(tool_choice)
    if name is not None:
        for function in functions:
            if function["name"] == name:
                return StructuredOutputsParams(json=_parameters(function))
        raise APIError(400, f"tool_choice names the function {brief(name)}, which is not in tools",
                       "tool_choice")
    defs: dict = {}  # "$defs" and draft-07's "definitions" -> their entries, from every tool
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                               "parameters": _hoisted(_parameters(f), defs)},
              "required": ["name", "parameters"]} for f in functions]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items} if len(items) > 1 else items[0]}
    if not parallel:
        schema["maxItems"] = 1
    schema.update((key, entries) for key, entries in defs.items() if entries)
    return StructuredOutputsParams(json=schema)


def each_tool_constraint(tools: list) -> list[tuple[str, StructuredOutputsParams]]:
    """(name, the grammar of its arguments alone) per tool: what finds the tool whose schema
    spoils a "required" grammar over them all."""
    functions = [tool_function(t, i) for i, t in enumerate(tools)]
    return [(f["name"], StructuredOutputsParams(json=_parameters(f))) for f in functions]


def _hoisted(parameters: dict, defs: dict) -> dict:
    """A tool's parameters without their `$defs` (or `definitions`), which join `defs`: a
    tool's "#/$defs/X" points at the root of the schema it is written in, which in the
    combined list is the list's root, so every tool's definitions must live there (vLLM
    hoists them so too). Two tools that define one name differently cannot share that root:
    a 400, in vLLM's words."""
    if not any(key in parameters for key in _DEFS):
        return parameters
    for key in _DEFS:
        own = parameters.get(key, {})
        if not isinstance(own, dict):
            raise APIError(400, f"a tool's parameters.{key} must be an object", "tools")
        hoisted = defs.setdefault(key, {})
        for name, schema in own.items():
            if name in hoisted and hoisted[name] != schema:
                raise APIError(400, f"Tool definition '{name}' has multiple schemas, which is not "
                               "supported.", "tools")
            hoisted[name] = schema
    return {k: v for k, v in parameters.items() if k not in _DEFS}
