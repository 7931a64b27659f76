"""The chat-template budget (pyserve/tokenizer/template_budget.py): each way a template can run
without end or build an unbounded prompt is stopped with a TemplateError, quickly; what real
templates do (loops with loop.last and loop.length, recursion through loop(), namespaces,
padding and formatting at sane sizes) renders as before. (tests/server/test_loop_held.py sends
the same bombs to a real server.)"""

import time

import pytest
from jinja2.exceptions import TemplateError

from pyserve.tokenizer import chat_template
from pyserve.tokenizer.template_budget import TemplateBudgetError

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


def render(template: str, messages=MESSAGES) -> str:
    return chat_template.render(template, messages, True, {})


BOMBS = {
    "repeated string": "{{ 'ab ' * 10000000 }}",
    "repeated list": "{{ (range(100000)|list) * 100 }}",
    "doubling with ~": "{% set ns = namespace(s='ab') %}{% for i in range(60) %}"
                       "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "doubling with +": "{% set ns = namespace(s='ab') %}{% for i in range(60) %}"
                       "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
    "center filter": "{{ 'x'|center(1000000000) }}",
    "center method": "{{ 'x'.center(1000000000) }}",
    "format filter width": "{{ '%*s'|format(1000000000, 'x') }}",
    "percent width": "{{ '%1000000000s' % 'x' }}",
    "str.format width": "{{ '{:>1000000000}'.format('x') }}",
    "str.format nested width": "{{ '{:>{}}'.format('x', 1000000000) }}",
    "integer power": "{{ 10 ** 10000000 }}",
    "batch fill": "{{ [1]|batch(1000000000, 'x')|list }}",
    "tojson indent": "{{ messages|tojson(indent=1000000000) }}",
    "output size": "{% for i in range(100000) %}{% for j in range(1000) %}{{ 'x' * 1000 }}"
                   "{% endfor %}{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_bombs_are_refused_quickly(name):
    started = time.monotonic()
    with pytest.raises(TemplateBudgetError):
        render(BOMBS[name])
    assert time.monotonic() - started < 5.0


@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}",
    "{% macro f() %}{% for i in range(100000) %}{% endfor %}{% endmacro %}"
    "{% for i in range(100000) %}{{ f() }}{% endfor %}",
    "{% for m in messages recursive %}{% for i in range(100000) %}{% endfor %}"
    "{{ loop(messages) if m.role == 'user' }}{% endfor %}",
])
def test_endless_loops_stop_at_the_deadline(template):
    from pyserve.tokenizer.template_budget import render_within_budget

    started = time.monotonic()
    with pytest.raises(TemplateBudgetError, match="did not render within 0.3 s"):
        render_within_budget(chat_template.compile_template(template),
                             {"messages": MESSAGES}, seconds=0.3)
    assert time.monotonic() - started < 3.0


def test_what_real_templates_do_still_renders():
    template = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                "{{ loop.index }}/{{ loop.length }}{{ '=' * 3 }}{{ m.role|center(11) }}"
                "{{ '%-5s|' % m.content }}{{ '{:>4}'.format(m.content) }}"
                "{% if loop.last %}!{% endif %}\n{% endfor %}{{ ns.n }}{{ 2 ** 10 }}"
                "{{ messages|tojson(indent=2)|length > 0 }}{{ [0] * 3 }}")
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template)
    expected = plain.render(messages=MESSAGES, add_generation_prompt=True)
    assert render(template) == expected and "2/2=== assistant yo   |  yo!" in expected


def test_lipsum_is_gone_and_sandbox_errors_remain_template_errors():
    with pytest.raises(TemplateError):
        render("{{ lipsum(100000000) }}")
    with pytest.raises(TemplateError):
        render("{{ ''.__class__ }}x{{ messages.__class__.__mro__ }}")
