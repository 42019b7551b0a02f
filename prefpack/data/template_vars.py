"""What a chat template reads, found by parsing it with Jinja's own parser (not by searching its text).

A substring test is fooled both ways: SmolLM3's template holds "tools" only inside ``xml_tools`` (the variable it
reads the tool schemas from), and a template may name ``tool_calls`` in a comment it never acts on. Parsing gives
the template's free variables (``tools``, ``xml_tools``, ``documents``, ``enable_thinking``...) and every key it
reads off a value (``message.tool_calls``, ``message['tool_calls']``, ``'tool_calls' in message``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

# The variables a template may read a row's tool schemas from, in the order they are preferred: apply_chat_template's
# own argument, then SmolLM3's (``apply_chat_template(messages, xml_tools=tools)``, as its model card shows).
TOOL_VARIABLES = ("tools", "xml_tools")


@dataclass(frozen=True)
class TemplateReads:
    variables: frozenset[str]  # free variables: given by the caller, not set inside the template
    keys: frozenset[str]  # attribute and item names read anywhere (message.tool_calls, tool['function'], ...)

    @property
    def tools_variable(self) -> str | None:
        """The variable a row's tools are passed as; None when the template reads none (its tools would be lost)."""
        return next((name for name in TOOL_VARIABLES if name in self.variables), None)

    @property
    def reads_tool_calls(self) -> bool:
        return "tool_calls" in self.keys

    def unread(self, names) -> list[str]:
        """The template variables among `names` the template never reads (passing them changes nothing)."""
        return sorted(n for n in names if n not in self.variables)


def template_reads(template: str | dict | None) -> TemplateReads:
    """What `template` reads (a tokenizer's ``chat_template``: one template, or several by name, all counted)."""
    if not template:
        return TemplateReads(frozenset(), frozenset())
    sources = (template,) if isinstance(template, str) else tuple(str(t) for t in template.values())
    parts = [_reads(source) for source in sources]
    return TemplateReads(frozenset().union(*(p.variables for p in parts)), frozenset().union(*(p.keys for p in parts)))


def sandbox():
    """The Jinja environment transformers renders chat templates in (sandboxed, {% generation %}, loop controls)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment(extensions=[_generation_extension(), "jinja2.ext.loopcontrols"])


@functools.lru_cache(maxsize=16)
def _reads(source: str) -> TemplateReads:
    import jinja2
    from jinja2 import meta, nodes

    env = sandbox()
    try:
        tree = env.parse(source)
    except jinja2.TemplateSyntaxError:
        # apply_chat_template fails on it too, naming the error per row; until then assume it reads everything
        words = frozenset(source.replace("'", " ").replace('"', " ").replace(".", " ").split())
        return TemplateReads(words, words)
    keys = {n.attr for n in tree.find_all(nodes.Getattr)}
    keys |= {n.arg.value for n in tree.find_all(nodes.Getitem) if isinstance(n.arg, nodes.Const)}
    for test in tree.find_all(nodes.Compare):  # 'tool_calls' in message
        if isinstance(test.expr, nodes.Const) and any(op.op in ("in", "notin") for op in test.ops):
            keys.add(test.expr.value)
    return TemplateReads(frozenset(meta.find_undeclared_variables(tree)), frozenset(k for k in keys
                                                                                   if isinstance(k, str)))


@functools.cache
def _generation_extension():
    """transformers' ``{% generation %}...{% endgeneration %}`` block (assistant-text markers), parsed as its body."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    return Generation
