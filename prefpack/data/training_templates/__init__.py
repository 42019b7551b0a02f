"""Which chat template prepare renders chat rows with: a training template shipped here when the tokenizer's own
is one prefpack recognises (its sha256), the file given to ``prepare --chat-template``, or the tokenizer's own.

The inference templates of Qwen3, Qwen3.5 (thinking), DeepSeek-R1(-Distill) and gpt-oss render an earlier turn
differently once more messages follow (reasoning dropped, a closing token changed, a generation prompt no reply
continues), so a reply cannot be cut out of the conversation. Their training templates here render each message
the same whatever follows and mark what the model wrote with ``{% generation %}`` tags, so the scored tokens come
from one rendering (``chat_masks``). The tokenizer itself is left unchanged: only the rendering differs.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources

from prefpack.errors import PrefpackError
from prefpack.tokenizer import template_sha

EARLIER_REASONING = ("dropped", "kept", "scored")  # what a training template does with earlier turns' reasoning
OWN = "tokenizer"  # --chat-template tokenizer: the tokenizer's own template, even when prefpack knows a better one


class ChatTemplateError(PrefpackError, ValueError):
    """--chat-template or --earlier-reasoning cannot be used."""


@dataclass(frozen=True)
class Family:
    name: str  # shown to the user
    file: str  # the training template, in this folder
    signature: tuple[str, ...]  # strings the family's templates hold: a variant prefpack does not know is named


# sha256 of the model's own template (leading and trailing whitespace stripped) -> its family
FAMILIES: dict[str, Family] = {
    "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8":
        Family("Qwen3", "qwen3.jinja", ("last_query_index", "reasoning_content", '<tool_call>\\n{\\"name\\"')),
    "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715":
        Family("Qwen3.5 (thinking)", "qwen3_5.jinja", ("last_query_index", "reasoning_content", "<function=")),
    "03cb8191637dd031cf7dca8bffd267b741d0cb46ab490dc7e452f62f02184b02":
        Family("DeepSeek-R1-Distill", "deepseek_r1.jinja", ("<｜Assistant｜><think>",)),
    "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146":
        Family("gpt-oss (harmony)", "gpt_oss.jinja", ("<|channel|>final<|message|>", "future_final_message")),
}

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


OWN_TEMPLATE = "the tokenizer's own"  # ChatTemplate.name of a tokenizer's own template


@dataclass(frozen=True)
class ChatTemplate:
    """The template chat rows are rendered with, and where it came from (recorded in meta.json)."""

    source: str
    name: str  # "the tokenizer's own", "prefpack's training template for Qwen3 (qwen3.jinja)", "--chat-template F"
    sha256: str
    markers: bool  # it marks assistant text with {% generation %}: masks come from one rendering
    training: bool = False  # one of prefpack's training templates (reads `earlier_reasoning`)
    resembles: str | None = None  # the tokenizer's own looks like this family's but is not the one known

    def to_json(self) -> dict:
        return {"name": self.name, "sha256": self.sha256, "chars": len(self.source), "generation_markers": self.markers}


def family_sha(source: str) -> str:
    """The key of a known template in ``FAMILIES`` (stripped, so a trailing newline a copy gained still matches)."""
    return hashlib.sha256(source.strip().encode("utf-8")).hexdigest()


def has_generation_markers(source: str) -> bool:
    return bool(_GENERATION_TAG.search(source))


def training_template(family: Family) -> str:
    return resources.files(__package__).joinpath(family.file).read_text(encoding="utf-8")


def make(source: str, name: str, training: bool = False, resembles: str | None = None) -> ChatTemplate:
    return ChatTemplate(source, name, template_sha(source), has_generation_markers(source), training, resembles)


def choose(own: str | None, given: str | None = None, given_name: str | None = None) -> ChatTemplate | None:
    """The template to render with: `given` (the text of --chat-template FILE) if any, else the training template
    of a recognised `own` template, else `own` itself (None: the tokenizer has no template)."""
    if given is not None:
        return make(given, given_name or "--chat-template", training="earlier_reasoning" in given)
    if not own:
        return None
    family = FAMILIES.get(family_sha(own))
    if family is not None:
        return make(training_template(family), f"prefpack's training template for {family.name} "
                    f"(data/training_templates/{family.file})", training=True)
    like = next((f.name for f in FAMILIES.values() if all(s in own for s in f.signature)), None)
    return make(own, OWN_TEMPLATE, resembles=like)


def select_template(tok, path: str | None, earlier_reasoning: str | None, layout: str,
                    log: Callable[[str], None]) -> ChatTemplate | None:
    """The template chat rows are rendered with (training_templates.choose), announced when it is not simply the
    tokenizer's own; --chat-template and --earlier-reasoning checked."""
    if earlier_reasoning is not None and earlier_reasoning not in EARLIER_REASONING:
        raise ChatTemplateError(f"--earlier-reasoning must be one of {', '.join(EARLIER_REASONING)}, not "
                           f"{earlier_reasoning!r}")
    own = tok.chat_template if isinstance(tok.chat_template, str) else None
    if path == OWN:
        template = make(own, OWN_TEMPLATE) if own else None
    elif path:
        try:
            with open(path, encoding="utf-8") as fh:
                given = fh.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ChatTemplateError(f"--chat-template {path!r}: cannot read it as a Jinja text file "
                               f"({getattr(exc, 'strerror', None) or exc})") from None
        template = choose(own, given, f"--chat-template {path}")
    else:
        template = choose(own)
    if template is not None:
        check_parses(template)
    if layout in ("pairs", "text-pairs") or template is None:
        return template
    if template.training:
        log(f"chat template: rendering chat rows with {template.name}, since the tokenizer's own renders earlier "
            "turns differently once more messages follow; scored tokens come from one rendering of each "
            f"conversation, earlier turns' reasoning {earlier_reasoning or 'dropped'} (--earlier-reasoning); "
            "--chat-template tokenizer keeps the tokenizer's own")
    elif template.markers:
        log(f"chat template: {template.name} marks assistant text with {{% generation %}}: scored tokens come from "
            "one rendering of each conversation")
    if earlier_reasoning is not None and not template.training:
        log(f"note: --earlier-reasoning has no effect with {template.name} template (only prefpack's training "
            "templates and --chat-template files that read `earlier_reasoning` use it)")
    return template


def check_parses(template: ChatTemplate) -> None:
    """A template that does not parse refused once, naming it and the line (transformers would fail on every row,
    and prepare count each as a bad row of the data)."""
    import jinja2

    from prefpack.data.template_vars import sandbox

    try:
        sandbox().parse(template.source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template {template.name}: it does not parse (line {exc.lineno}: {exc.message}); "
                                "mend it, or give another with --chat-template FILE") from None


def template_meta(template: ChatTemplate | None, earlier_reasoning: str | None) -> dict | None:
    """What meta.json records of the template chat rows were rendered with."""
    if template is None:
        return None
    out = template.to_json()
    if template.training:
        out["earlier_reasoning"] = earlier_reasoning or "dropped"
    return out
