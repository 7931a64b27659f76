"""A time and output-size budget for rendering a chat template, checked as the render goes.

Templates are untrusted code (a request's own with --trust-request-chat-template, or a
model's), and Jinja's sandbox bounds what they may reach, not what they may cost: nested
`range(100000)` loops run for hours, `'ab ' * 10**7` builds 30 MB in one step. A render runs
in a worker thread, where pure-Python bytecode lets the event loop have its turn; what it must
not do is run without end, build an unbounded prompt, or sit in one long C call holding the
interpreter's lock. BudgetedEnvironment makes a runaway render raise TemplateBudgetError (a
TemplateError: the request's 400) instead:

    loops       every for-loop's iterable is wrapped at code generation in an iterator that
                checks the deadline every CHECK_EVERY items (a loop with an empty body too)
    calls       every call the sandbox sees (macros, methods, globals) checks the deadline
    repetition  `*` of a string or list, `**` of integers, and the padding methods and
                filters (center, ljust, zfill, format widths, batch, slice, ...) are refused
                before they run when their result would pass MAX_REPEAT items or MAX_POWER_BITS
    output      the rendered text is counted as it is generated, and each `~`, `+` and
                `%` result before it is kept, against max_chars

The budget of the render under way lives in a ContextVar: each worker thread renders one
template at a time, and the compiled template (cached, shared) carries no per-render state."""

from __future__ import annotations

import contextvars
import functools
import re
import time

from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import TemplateError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_SECONDS = 10.0  # real templates render a long conversation in well under a second
MAX_RENDERED_CHARS = 64 * 1024 * 1024  # twice the default --max-request-body-bytes
MAX_REPEAT = 1_000_000  # items one repetition or padding may make (Jinja's range stops at 100,000)
MAX_POWER_BITS = 1_000_000  # an integer power past this many bits is seconds of one C call
CHECK_EVERY = 256  # loop items between two looks at the clock
# str methods whose integer arguments are output widths
_PADDING_METHODS = frozenset(("center", "ljust", "rjust", "zfill", "expandtabs"))
_NESTED_FORMAT_FIELD = re.compile(r"\{[^{}]*\{|%[-#0 +]*\*")  # a width taken from an argument
_LONG_NUMBER = re.compile(r"\d{7,}")


class TemplateBudgetError(TemplateError):
    pass


class RenderBudget:
    def __init__(self, seconds: float, max_chars: int):
        self.seconds, self.max_chars = seconds, max_chars
        self.deadline = time.monotonic() + seconds

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateBudgetError(f"the chat template did not render within {self.seconds:g} s")

    def check_size(self, size: int, what: str = "its output") -> None:
        if size > self.max_chars:
            raise TemplateBudgetError(f"the chat template's {what} passed {self.max_chars:,} "
                                      "characters")


_budget: contextvars.ContextVar[RenderBudget | None] = contextvars.ContextVar(
    "pyserve_template_budget", default=None)


def _current() -> RenderBudget:
    budget = _budget.get()
    # rendered without render_within_budget: sizes are still checked, the clock is not
    return budget if budget is not None else RenderBudget(RENDER_SECONDS, MAX_RENDERED_CHARS)


def render_within_budget(template, variables: dict, seconds: float | None = None,
                         max_chars: int = MAX_RENDERED_CHARS) -> str:
    """template (compiled by a BudgetedEnvironment) rendered with variables; a render past
    `seconds` (RENDER_SECONDS by default) or past `max_chars` of output raises
    TemplateBudgetError."""
    budget = RenderBudget(RENDER_SECONDS if seconds is None else seconds, max_chars)
    token = _budget.set(budget)
    try:
        pieces, size = [], 0
        for piece in template.generate(**variables):
            size += len(piece)
            budget.check_size(size)
            pieces.append(piece)
        return "".join(pieces)
    finally:
        _budget.reset(token)


def _repeat_limit(count: int, unit: int) -> None:
    if count * max(unit, 1) > MAX_REPEAT:
        raise TemplateBudgetError(f"the chat template repeats a value into more than "
                                  f"{MAX_REPEAT:,} items")


def _check_widths(args, kwargs) -> None:
    for value in (*args, *kwargs.values()):
        if type(value) is int and abs(value) > MAX_REPEAT:
            _repeat_limit(abs(value), 1)


def _check_format(template_text: str, args, kwargs) -> None:
    """A format string's widths (written in it, or taken from its arguments) within MAX_REPEAT."""
    for digits in _LONG_NUMBER.findall(template_text):
        _repeat_limit(int(digits), 1)
    if _NESTED_FORMAT_FIELD.search(template_text):
        _check_widths(args if isinstance(args, (tuple, list)) else (args,), kwargs)


class _BudgetedIterable:
    """An iterable that looks at the clock as it is walked; sized when its source is (for
    loop.length and loop.last)."""

    def __init__(self, iterable):
        self._iterable = iterable

    def __len__(self) -> int:
        return len(self._iterable)

    def __iter__(self):
        budget = _current()
        for n, item in enumerate(self._iterable):
            if n % CHECK_EVERY == 0:
                budget.check_time()
            yield item


class BudgetExtension(Extension):
    """What the rewritten templates call: each for-loop's iterable goes through
    budgeted_iterable (an ExtensionAttribute: a name no template variable can shadow)."""

    @staticmethod
    def budgeted_iterable(iterable):
        return _BudgetedIterable(iterable)


class BudgetedCodeGenerator(CodeGenerator):
    def visit_For(self, node, frame):
        wrapper = nodes.ExtensionAttribute(BudgetExtension.identifier, "budgeted_iterable")
        if not (isinstance(node.iter, nodes.Call) and node.iter.node == wrapper):
            node.iter = nodes.Call(wrapper, [node.iter], [], None, None).set_lineno(node.lineno)
        super().visit_For(node, frame)

    def visit_Concat(self, node, frame):  # `~`: a string that may double on every pass
        self.write("environment.checked_text(")
        super().visit_Concat(node, frame)
        self.write(")")


class BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, with the budget checks above."""

    code_generator_class = BudgetedCodeGenerator
    intercepted_binops = frozenset(("*", "**", "+", "%"))

    def __init__(self, **options):
        super().__init__(**options)
        self.add_extension(BudgetExtension)
        self.globals.pop("lipsum", None)  # its own loop makes any number of words

    def __setattr__(self, name, value):
        # filters added later (tojson) are checked too
        if name == "filters" and not isinstance(value, _CheckedFilters):
            value = _CheckedFilters(value)
        super().__setattr__(name, value)

    @staticmethod
    def checked_text(text):
        _current().check_size(len(text), "text")
        return text

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (the sandbox's own names)
        _current().check_time()
        # str.format reaches here as the sandbox's wrapper of the bound method
        owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        if isinstance(owner, str):
            name = getattr(__obj, "__name__", "")
            if name in _PADDING_METHODS:
                _check_widths(args, kwargs)
            elif name in ("format", "format_map"):
                _check_format(owner, args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context, operator, left, right):
        budget = _current()
        budget.check_time()
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
                    _repeat_limit(count, len(seq))
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            if abs(left).bit_length() * right > MAX_POWER_BITS:
                raise TemplateBudgetError(f"the chat template computes an integer of more than "
                                          f"{MAX_POWER_BITS:,} bits")
        elif operator == "%" and isinstance(left, str):
            _check_format(left, right, {})
        elif operator == "+" and isinstance(left, (str, list, tuple)) and hasattr(right, "__len__"):
            budget.check_size(len(left) + len(right), "text")
        result = super().call_binop(context, operator, left, right)
        if operator == "%" and isinstance(result, str):
            budget.check_size(len(result), "text")
        return result


class _CheckedFilters(dict):
    def __init__(self, filters):
        super().__init__((name, _checked_filter(f)) for name, f in filters.items())

    def __setitem__(self, name, value):
        super().__setitem__(name, _checked_filter(value))


def _checked_filter(function):
    """A filter whose integer arguments (widths, counts: center, indent, batch, slice,
    tojson's indent, format's widths) stay within MAX_REPEAT, and that looks at the clock."""
    if getattr(function, "_budgeted", False):
        return function
    passed = 1 if getattr(function, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(function)
    def checked(*args, **kwargs):
        _current().check_time()
        value, rest = args[passed] if len(args) > passed else None, args[passed + 1:]
        if function.__name__ in ("do_format", "format") and isinstance(value, str):
            _check_format(value, rest, kwargs)
        else:
            _check_widths(rest, kwargs)
        return function(*args, **kwargs)

    checked._budgeted = True
    return checked
