"""What the router reads from a chat template is what vLLM reads from it: the content
format, developer-role support and the variables, on the templates vLLM ships and on
shapes its syntax walk treats specially."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpserve.router.kv.templates import read_template
from tests.router.kv.chat_templates import PARTS_TEMPLATE, TOOLS_TEMPLATE

vllm = pytest.importorskip("vllm")

SHIPPED = sorted((Path(vllm.__file__).parent / "transformers_utils" / "chat_templates")
                 .glob("*.jinja"))
SHAPES = {
    "string": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    "parts": "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}"
             "{% endfor %}",
    "attribute": "{% for m in messages %}{% for p in m.content %}{{ p }}{% endfor %}{% endfor %}",
    "filtered": "{% for m in messages %}{% for p in m.content | list %}{{ p }}{% endfor %}"
                "{% endfor %}",
    "alias": "{% set msgs = messages[1:] %}{% for m in msgs %}{% for p in m['content'] %}"
             "{{ p }}{% endfor %}{% endfor %}",
    "assigned content": "{% for m in messages %}{% set content = m.content %}"
                        "{% for p in content %}{{ p }}{% endfor %}{% endfor %}",
    "macro": "{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
             "{% for m in messages %}{{ show(m['content']) }}{% endfor %}",
    "macro keyword": "{% macro show(x, c) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}"
                     "{% for m in messages %}{{ show(1, c=m.content) }}{% endfor %}",
    "tuple target": "{% for m in messages %}{% for a, b in m.content %}{{ a }}{% endfor %}"
                    "{% endfor %}",
    "tuple alias": "{% set a, b = messages %}{% for m in messages %}{% for p in m.content %}"
                   "{{ p }}{% endfor %}{% endfor %}",
    "developer": "{% for m in messages %}{% if m.role == 'developer' %}D{% endif %}"
                 "{{ m.content }}{% endfor %}",
    "generation block": "{% for m in messages %}{% generation %}{{ m.content }}"
                        "{% endgeneration %}{% endfor %}{{ custom_var }}",
    "tools": TOOLS_TEMPLATE,
    "test parts": PARTS_TEMPLATE,
}
TEMPLATES = {**{p.name: p.read_text() for p in SHIPPED}, **SHAPES}


@pytest.mark.parametrize("source", TEMPLATES.values(), ids=TEMPLATES.keys())
def test_the_template_reads_as_vllm_reads_it(source):
    from vllm.renderers.hf import (
        _detect_content_format,
        _detect_developer_role_support,
        _resolve_chat_template_kwargs,
    )

    facts = read_template(source)
    assert facts.content_format == _detect_content_format(source, default="string")
    assert facts.knows_developer == _detect_developer_role_support(source)
    assert facts.variables == _resolve_chat_template_kwargs(source)


def test_the_shapes_cover_both_formats():
    formats = {read_template(s).content_format for s in SHAPES.values()}
    assert formats == {"string", "openai"}
