"""`join` in a checkpoint's chat template (the filter and the str method), and lists or strings
built up by repeated `+` and `*`: a result past the sandbox's size bound is refused with
TemplateLimitError (an InputError naming the template) before it is built, even when the
template never outputs it; joins within the bound give jinja's own answer."""

from __future__ import annotations

import time

import pytest

from sparsegen.errors import InputError
from sparsegen.llm.chat import ChatTemplate
from sparsegen.llm.template_sandbox import MAX_CHARS, BoundedSandbox, render_bounded

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
HUGE = {  # each would build ~1e10 characters (tens of GB) if it ran
    "join filter, long separator": "{{ (['a'] * 100000)|join('x' * 100000)|length }}",
    "join method, long separator": "{{ ('x' * 100000).join(['a'] * 100000)|length }}",
    "join filter over long items": "{{ (['y' * 100000] * 100)|join|length }}{{ ((['y' * 100000] * 100)|join * 1000)|length }}",
    "join over a generator": "{{ (range(100000)|map('string'))|join('z' * 100000)|length }}",
    "join over an attribute": "{{ ([{'c': 'q' * 10000}] * 100000)|join(attribute='c')|length }}",
    "join of joins": "{% set s = (['ab'] * 50000)|join('-' * 200) %}{{ (s, s)|join|length }}",
    "list growth by +": "{% set ns = namespace(l=['a' * 1000]) %}{% for i in range(40) %}"
    "{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l|length }}",
    "list growth by *": "{% set ns = namespace(l=['a' * 1000]) %}{% for i in range(40) %}"
    "{% set ns.l = ns.l * 2 %}{% endfor %}{{ ns.l|length }}",
    "string growth by *": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
    "{% set ns.s = ns.s * 2 %}{% endfor %}{{ ns.s|length }}",
}


@pytest.mark.parametrize("name", list(HUGE))
def test_a_huge_join_or_growth_is_refused_before_it_is_built(name):
    start = time.perf_counter()
    with pytest.raises(InputError, match=r"chat template \(ckpt\) failed: TemplateLimitError: .*at most"):
        ChatTemplate(HUGE[name], origin="ckpt").render(MSGS)
    assert time.perf_counter() - start < 30  # refused early, not after building ~1e10 characters


@pytest.mark.slow  # builds lists of millions of items
def test_the_join_bound_is_at_the_limit_not_below():
    n = MAX_CHARS // 4
    # n items of one character with n - 1 one-character separators: 2n - 1 characters.
    fine = f"{{{{ (['a'] * {n})|join(',')|length }}}}|{{{{ ','.join(['a'] * {n})|length }}}}"
    assert ChatTemplate(fine).render(MSGS) == f"{2 * n - 1}|{2 * n - 1}"
    over = f"{{{{ (['ab'] * {n})|join(',' * 3)|length }}}}"  # 5n - 3 characters: over the bound
    with pytest.raises(InputError, match="the filter 'join' would build"):
        ChatTemplate(over).render(MSGS)


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages|map(attribute='role')|join(', ') }}",
        "{{ messages|join('|', attribute='content') }}",
        "{{ [1, 2, 3]|join }}",
        "{{ '-'.join(['a', 'b']) }}",
        "{{ ''.join([]) }}|{{ []|join('x') }}",
        "{{ range(5)|join(' ') }}",
        "{% for m in messages %}{{ [m.role, m.content]|join(': ') }}\n{% endfor %}",
    ],
)
def test_a_join_within_the_bound_renders_as_jinja_renders_it(source):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    want = ImmutableSandboxedEnvironment().from_string(source).render(messages=MSGS)
    assert render_bounded(BoundedSandbox().from_string(source), "t", InputError, messages=MSGS) == want
