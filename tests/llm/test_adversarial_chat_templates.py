"""Chat templates from a checkpoint are code someone else wrote. Each one that fails or tries to
exhaust the process when rendered is an InputError naming the template, within a bounded time
and memory; the server answers 400 and goes on; ordinary templates render as before."""

from __future__ import annotations

import json
import sys
import time

import pytest
from helpers import extras

from sparsegen.errors import InputError
from sparsegen.llm.chat import PHI3SMALL_CHAT_TEMPLATE, ChatTemplate
from sparsegen.llm.template_sandbox import MAX_CHARS, MAX_INT_ARG

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
RANGE = "{% for i in range(100000) %}"
BAD = {
    "zero division": "{{ 1/0 }}",
    "modulo by zero": "{{ 1 % 0 }}",
    "huge range": "{% for i in range(10**9) %}x{% endfor %}",
    "nested ranges": RANGE + RANGE + "{% endfor %}{% endfor %}",
    "nested loops over strings": "{% for c in 'a' * 100000 %}{% for d in 'a' * 100000 %}{% endfor %}{% endfor %}",
    "string repeat": "{{ 'a' * 10**10 }}",
    "list repeat": "{{ ['a' * 1000000] * 1000 }}",
    "center filter": "{{ 'a'|center(10**10) }}",
    "center method": "{{ 'a'.center(10**10) }}",
    "ljust method": "{{ 'a'.ljust(10**10) }}",
    "indent filter": "{{ 'x'|indent(10**9) }}",
    "batch filter": "{{ range(10)|batch(10**9)|list }}",
    "percent width": "{{ '%9999999999d' % 1 }}",
    "percent star width": "{{ '%*d' % (10**9, 1) }}",
    "format width": "{{ '{:>9999999999}'.format(1) }}",
    "format nested width": "{{ '{:>{w}}'.format(1, w=10**9) }}",
    "format filter width": "{{ '%10000000000s'|format('a') }}",
    "replace growth": "{{ 'ab'|replace('', 'x' * 10000)|replace('', 'y' * 10000) }}",
    "replace method growth": "{{ ('ab'.replace('', 'x' * 10000)).replace('', 'y' * 10000) }}",
    "concat doubling": "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s|length }}",
    "plus doubling": "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "huge power": "{{ 2 ** (10 ** 9) }}",
    "output flood": "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
    "lipsum": "{{ lipsum(10**6) }}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "undefined attribute": "{{ messages.foo.bar }}",
    "raise_exception": "{{ raise_exception('only user and assistant roles') }}",
    "mutating the messages": "{{ messages.append(1) }}",
    "python internals": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "type error": "{{ messages + 1 }}",
    "index error": "{{ messages[99].content }}",
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_failing_template_is_an_input_error_naming_it(name):
    tracer = sys.gettrace()
    start = time.perf_counter()
    template = ChatTemplate(BAD[name], origin="ckpt/tokenizer_config.json")
    with pytest.raises(InputError, match=r"chat template \(ckpt/tokenizer_config\.json\) failed"):
        template.render(MSGS)
    assert time.perf_counter() - start < 20  # bounded work: the step budget, not the machine's patience
    assert sys.gettrace() is tracer  # the step counter is gone after the render


def test_python_internals_stay_out_of_reach():
    out = ChatTemplate("{{ ''.__class__ }}|{{ messages.__len__ }}|{{ cycler.__init__ }}").render(MSGS)
    assert out == "||"


def test_a_template_nested_too_deeply_to_parse():
    with pytest.raises(InputError, match="does not compile"):
        ChatTemplate("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", origin="x")


ORDINARY = (
    "{% for m in messages %}{% if m['role'] == 'system' %}<<{{ m['content']|trim }}>>"
    "{% else %}{{ '[' ~ m.role|upper ~ ']' }}{{ m.content|indent(2) }}{% endif %}"
    "{% if not loop.last %}\n{% endif %}{% endfor %}"
    "|{{ messages|map(attribute='role')|join(',') }}|{{ messages|length }}|{{ '%s-%d'|format('a', 3) }}"
    "|{{ messages[1]|tojson }}|{{ 'ab' * 3 }}|{{ '{0}:{1}'.format('k', 2) }}|{{ 'a-b'.replace('-', '+') }}"
    "|{{ range(3)|list|sum }}|{{ 2 ** 10 }}|{{ '%05d' % 42 }}|{{ 'x'|center(5) }}|{{ [1, 2] + [3] }}"
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}|{{ ns.n }}"
    "{% if add_generation_prompt %}<go>{% endif %}"
)


def test_ordinary_templates_render_as_jinja_renders_them():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, autoescape=False)
    # transformers' `tojson` (what chat templates are written for): json.dumps, keys unsorted
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    outputs = []
    for source in (ORDINARY, PHI3SMALL_CHAT_TEMPLATE):
        want = env.from_string(source).render(
            messages=MSGS, add_generation_prompt=True, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
        )
        outputs.append(ChatTemplate(source).render(MSGS))
        assert outputs[-1] == want
    assert (
        "<<be brief>>" in outputs[0] and "|system,user|2|a-3|" in outputs[0] and outputs[0].endswith("|2<go>")
    )


def test_the_bounds_are_at_their_limits_not_below():
    c, n = MAX_CHARS, MAX_INT_ARG
    fine = f"{{{{ ('x' * {c})|length }}}}|{{{{ range({n})|list|length }}}}|{{{{ 'a'|center({n})|length }}}}"
    assert ChatTemplate(fine).render(MSGS) == f"{c}|{n}|{n}"
    with pytest.raises(InputError, match="at most"):
        ChatTemplate(f"{{{{ ('x' * {c + 1})|length }}}}").render(MSGS)


def test_a_checkpoint_template_fails_the_request_not_the_llm(tmp_path):
    from sparsegen import LLM, SamplingParams

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": BAD["nested ranges"]}))
    llm = LLM(random="tiny", max_num_seqs=2)
    llm.chat_template = ChatTemplate.from_folder(tmp_path)
    with pytest.raises(InputError, match=r"tokenizer_config\.json\) failed"):
        llm.chat(MSGS, SamplingParams(max_tokens=1), use_tqdm=False)
    assert len(llm.generate(["hi"], SamplingParams(max_tokens=1), use_tqdm=False)[0].token_ids) == 1


def test_the_server_answers_400_for_a_failing_template():
    httpx = extras.require("httpx")
    extras.require("fastapi")
    from sparsegen import LLM
    from sparsegen.serve.server import ServerThread

    llm = LLM(random="tiny", max_num_seqs=2)
    llm.chat_template = ChatTemplate(BAD["zero division"], origin="the checkpoint's chat_template.jinja")
    with ServerThread(llm, max_queue=2) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        body = {"model": "random-tiny", "messages": MSGS, "max_tokens": 1}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and "chat_template.jinja" in r.json()["error"]["message"], r.text
        assert c.get("/health").status_code == 200
        ok = c.post("/v1/completions", json={"model": "random-tiny", "prompt": "hi", "max_tokens": 1})
        assert ok.status_code == 200
