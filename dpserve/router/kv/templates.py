"""What a chat template says about itself, read from its Jinja source as vLLM 0.32
reads it (`vllm/renderers/hf.py`), so the router renders messages as the engine does.

Three facts decide how vLLM shapes a conversation before the template sees it:

- its *content format*: a template that loops over a message's content gets every
  content as a list of parts (``[{"type": "text", "text": ...}]``, "openai"); any
  other gets the parts' texts joined by newlines ("string"). vLLM tells them apart
  by walking the template's syntax tree; `content_format` is that walk, ported.
- whether it knows the ``developer`` role: if its source never names it, vLLM
  turns developer messages into system messages.
- the variables it reads: a request's `chat_template_kwargs` reach the template only
  for names it reads or names `apply_chat_template` takes.

Pure: a template string in, facts out. Parsing costs ~1 ms for a large template, so
callers keep one `TemplateFacts` per template.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox

ContentFormat = Literal["string", "openai"]


class _GenerationTag(jinja2.ext.Extension):
    """Parses transformers' ``{% generation %}`` blocks (assistant-mask templates)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_generation_support")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)


@dataclass(frozen=True, slots=True)
class TemplateFacts:
    source: str
    content_format: ContentFormat
    """How message content reaches the template (vLLM's "auto" detection)."""
    knows_developer: bool
    """The template names the ``developer`` role; otherwise vLLM renames it ``system``."""
    variables: frozenset[str]
    """Names the template reads and does not set."""


def read_template(source: str) -> TemplateFacts:
    """The facts of `source`; raises jinja2.TemplateSyntaxError if it does not parse."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    tree = env.parse(source)
    try:
        content_format: ContentFormat = "openai" if _loops_over_content(tree) else "string"
    except _Unreadable:
        content_format = "string"
    return TemplateFacts(
        source=source, content_format=content_format,
        knows_developer='"developer"' in source or "'developer'" in source,
        variables=frozenset(jinja2.meta.find_undeclared_variables(tree)))


# --- vLLM's content-format detection (hf.py, `_iter_nodes_assign_content_item`) ---------


def _is_var(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return (_is_var(node.node, name) and isinstance(node.arg, jinja2.nodes.Const)
                and node.arg.value == key)
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_var_or_elems(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


class _Unreadable(Exception):
    """A shape vLLM's walk asserts against (a tuple target): it then says "string"."""


def _name_of(target: jinja2.nodes.Node) -> str:
    if not isinstance(target, jinja2.nodes.Name):
        raise _Unreadable
    return target.name


def _aliases(root: jinja2.nodes.Node, name: str) -> list[str]:
    """`name` and every variable assigned from it (or from one of its elements)."""
    found = [name]
    pending = deque([name])
    while pending:
        current = pending.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _is_var_or_elems(assign.node, current):
                alias = _name_of(assign.target)
                found.append(alias)
                if alias != current:
                    pending.append(alias)
    return found


def _message_vars(root: jinja2.nodes.Node) -> list[str]:
    """Loop variables of ``{% for message in messages %}`` (or an alias of messages)."""
    names = _aliases(root, "messages")
    return [_name_of(loop.target) for loop in root.find_all(jinja2.nodes.For)
            if any(_is_var_or_elems(loop.iter, n) for n in names)]


def _loops_over_content(root: jinja2.nodes.Node) -> bool:
    """Whether a loop walks a message's content: directly, through a macro's parameter,
    or as a top-level variable named ``content``. The first such loop decides."""
    messages = _message_vars(root)

    def is_content(node: Any) -> bool:
        return any(_is_var_or_elems(node, m, "content") for m in messages)

    params_by_loop: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        names = [arg.name for arg in macro.args]
        params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            params.update(names[i] for i, arg in enumerate(call.args)
                          if i < len(names) and is_content(arg))
            params.update(kw.key for kw in call.kwargs
                          if isinstance(kw, jinja2.nodes.Keyword) and kw.key in names
                          and is_content(kw.value))
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if params:
                params_by_loop[id(loop)] = params
    for loop in root.find_all(jinja2.nodes.For):
        if is_content(loop.iter) or (isinstance(loop.iter, jinja2.nodes.Name) and (
                loop.iter.name in params_by_loop.get(id(loop), ())
                or (id(loop) not in in_macros and loop.iter.name == "content"))):
            _name_of(loop.target)
            return True
    return False
