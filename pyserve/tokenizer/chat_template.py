"""Chat templates rendered the way transformers renders them, without importing transformers.

Templates come from model repositories, so they are untrusted code: they run in Jinja's
immutable sandbox, with the environment transformers gives them (trim_blocks, lstrip_blocks,
loop controls, a `tojson` that keeps non-ASCII text, `raise_exception`, `strftime_now`, and
`dict`/`namespace` that cannot reach Python internals), and within a time and output-size
budget (template_budget.py: a runaway template is a TemplateError). Only what a plain conversation needs
is here; the tokenizer hands anything else (tools, documents, continued final messages,
`{% generation %}` tracking) to transformers itself."""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Message fields transformers copies into one another before rendering.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def is_plain_data(value, depth: int = 0) -> bool:
    """JSON-shaped data: what a template may see unchanged (transformers rebuilds anything
    else into inert placeholders, which only it knows how to do)."""
    if value is None or type(value) in (str, int, float, bool):
        return True
    if depth > 32:
        return False
    if type(value) is dict:
        return all(type(k) is str and is_plain_data(v, depth + 1) for k, v in value.items())
    if type(value) is list:
        return all(is_plain_data(v, depth + 1) for v in value)
    return False


def needs_transformers(template: str) -> bool:
    return bool(_GENERATION_TAG.search(template))


@lru_cache(maxsize=16)
def compile_template(template: str):
    import jinja2
    from jinja2.ext import loopcontrols

    from pyserve.tokenizer.template_budget import BudgetedEnvironment

    env = BudgetedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    class SafeNamespace(jinja2.utils.Namespace):
        # a namespace attribute named _x could lead a template to Python internals
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                SafeNamespace._refuse_private(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            SafeNamespace._refuse_private(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _refuse_private(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot set underscore-prefixed namespace attributes ({name!r})")

    class DictMaker:
        # `dict(...)` and `dict.fromkeys(...)` without handing the template the dict type itself
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=DictMaker(), namespace=SafeNamespace)
    return env.from_string(template)


def render(template: str, messages: list[dict], add_generation_prompt: bool, variables: dict,
           tools: list | None = None, documents: list | None = None) -> str:
    """messages: plain data, each a dict whose None values are already dropped."""
    from pyserve.tokenizer.template_budget import render_within_budget

    return render_within_budget(compile_template(template),
                                {"messages": messages, "tools": tools, "documents": documents,
                                 "add_generation_prompt": add_generation_prompt, **variables})


def check_budget(template: str, messages: list[dict], add_generation_prompt: bool,
                 variables: dict, tools: list | None, documents: list | None) -> None:
    """The render transformers is about to do (in its own sandbox, which has no budget), done
    here first with the output dropped: a template that runs past the budget raises its
    TemplateBudgetError here. Any other error is transformers' to report in its own words
    (its environment differs in details: `{% generation %}`, how it prepares messages)."""
    from pyserve.tokenizer.template_budget import TemplateBudgetError

    try:
        render(template, messages, add_generation_prompt, variables, tools, documents)
    except TemplateBudgetError:
        raise
    except Exception:
        pass
