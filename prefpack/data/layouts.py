"""Input layouts: their names, the fields a row of each is read from (renamed with ``prepare --NAME-field``), and
their detection from one row. Turning a row into an example is ``formats``.

Layouts:
- `pairs`: prompt / chosen / rejected strings.
- `text-pairs`: text / chosen / rejected strings (the Fast-LLM naming); the same as `pairs` otherwise.
- `messages`: prompt is a list of {role, content}; chosen / rejected are assistant message lists,
  rendered later through the tokenizer's chat template.
- `implicit`: only chosen / rejected, each a whole conversation (a string such as hh-rlhf's
  "\\n\\nHuman: ...\\n\\nAssistant: ..." or a message list); the prompt is their shared prefix cut back
  to the last assistant-turn boundary.
- `unpaired`: prompt / completion / label (KTO); prompt and completion are strings or message lists.
- `sharegpt`, `kto-messages`, `alpaca`: LLaMA-Factory's (``foreign_layouts``): ShareGPT ``conversations`` with one
  ``chosen`` / ``rejected`` message each; ``messages`` + ``label`` (the last message is the completion);
  ``instruction`` / ``input`` / ``chosen`` / ``rejected`` strings.
- `ranked`: prompt / completions, a list of several completions of one prompt with a score or a rank each
  (UltraFeedback-style: ``{"prompt": ..., "completions": [{"text": ..., "score": 8.5}, ...]}``, or plain texts with
  a parallel ``scores`` / ``ranks`` list; UltraFeedback's and Nectar's own field names are detected); stored with
  the prompt once, and the pairs it yields are drawn at train time (``data.ranked_pairs``).
"""

from __future__ import annotations

from dataclasses import dataclass

from prefpack.data.row_checks import DOCUMENTS_FIELD, KWARGS_FIELD, TOOLS_FIELD, InvalidRow

LAYOUTS = ("pairs", "text-pairs", "messages", "implicit", "unpaired", "ranked", "rlaif-v", "sharegpt", "kto-messages",
           "alpaca")
# The layouts whose rows are pairs (a pair store): they may carry a numeric ``margin`` field
PAIR_LAYOUTS = ("pairs", "text-pairs", "messages", "implicit", "rlaif-v", "sharegpt", "alpaca")
# LLaMA-Factory's layouts (``foreign_layouts`` turns their rows into rows of the layouts above), by their prompt field
FOREIGN_PROMPT_FIELDS = {"sharegpt": "conversations", "kto-messages": "messages", "alpaca": "instruction"}

# Vision-language rows (read only with prepare --processor, docs/images.md). TRL's layout: the `messages` layout whose
# prompt holds {"type": "image"} parts, with the images, in order, in an `images` column; TRL's unpaired (KTO) vision
# layout is the `unpaired` one with such a prompt and `images`, and a `ranked` row's message prompt may hold images the
# same way (they belong to the prompt its completions share). RLAIF-V's (openbmb/RLAIF-V-Dataset): one `image`, a
# `question` string and chosen / rejected strings.
IMAGES_FIELD = "images"
RLAIFV_IMAGE, RLAIFV_QUESTION = "image", "question"
VISION_LAYOUTS = ("messages", "rlaif-v", "unpaired", "ranked")

# A ranked row's completion: its text under one of these keys, and a score (higher is better) or a rank (1 is best).
# "answer"/"rank" are Nectar's (berkeley-nest/Nectar: answers = [{answer, model, rank}]), "response"/"overall_score"
# UltraFeedback's (openbmb/UltraFeedback: instruction, completions = [{response, overall_score, ...}]).
RANKED_TEXT_KEYS = ("text", "response", "completion", "content", "answer")
RANKED_SCORE_KEYS = ("score", "rating", "overall_score", "reward")
RANKED_RANK_KEY = "rank"
# Where detection looks for a ranked row's prompt and its completions when no field is named.
RANKED_PROMPT_FIELDS = ("prompt", "instruction")
RANKED_COMPLETIONS_FIELDS = ("completions", "answers", "responses")
# Completions given as a plain list (strings or message lists) take their scores from a parallel list here.
RANKED_SCORE_LISTS = ("scores", "ratings", "rewards")
RANKED_RANK_LIST = "ranks"

# Where an assistant reply starts in a whole-conversation string; the implicit prompt ends right after the
# last one that occurs in the two conversations' shared prefix. (name, marker), also listed in docs/data.md.
ASSISTANT_MARKER_FAMILIES = (
    ("Anthropic hh-rlhf", "\n\nAssistant:"),
    ("ChatML (Qwen, Yi, OpenHermes...)", "<|im_start|>assistant\n"),
    ("Llama 3", "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    ("Mistral / Llama 2", "[/INST]"),
    ("Gemma", "<start_of_turn>model\n"),
    ("Phi-3 / Zephyr", "<|assistant|>\n"),
    ("Phi-3 / Zephyr, no newline", "<|assistant|>"),
)
ASSISTANT_MARKERS = tuple(marker for _, marker in ASSISTANT_MARKER_FAMILIES)


# Columns of images or video: refused (a run must never train text-only on vision-language data without knowing it).
VISION_FIELDS = ("images", "image", "videos", "video", "image_url", "image_path", "pixel_values")


def used_fields(layout: str, f: Fields) -> frozenset[str]:
    """The columns a row of `layout` is read from; prepare reports the others once, by name."""
    chat = {TOOLS_FIELD, KWARGS_FIELD, DOCUMENTS_FIELD, f.spans, *({f.margin} if layout in PAIR_LAYOUTS else ())}
    if layout == "rlaif-v":
        return frozenset({RLAIFV_IMAGE, RLAIFV_QUESTION, f.chosen, f.rejected, f.margin})
    if layout == "messages":
        return frozenset({f.prompt, f.chosen, f.rejected, IMAGES_FIELD, *chat})
    if layout == "implicit":
        return frozenset({f.chosen, f.rejected, *chat})
    if layout == "unpaired":
        return frozenset({f.prompt, f.completion, f.label, IMAGES_FIELD, *chat})
    if layout == "ranked":
        return frozenset({f.prompt, f.completions, *({f.scores} - {None}), *RANKED_SCORE_LISTS, RANKED_RANK_LIST,
                          IMAGES_FIELD, *chat})
    if layout == "sharegpt":
        return frozenset({f.prompt, f.chosen, f.rejected, "system", *chat})
    if layout == "kto-messages":
        return frozenset({f.prompt, f.label, "system", *chat})
    if layout == "alpaca":
        return frozenset({f.prompt, "input", "system", "history", f.chosen, f.rejected, f.margin})
    return frozenset({f.prompt, f.chosen, f.rejected, *chat})


# The fields a user can rename (`prepare --NAME-field`), with what each holds.
FIELD_HELP = {
    "prompt": "prompt", "chosen": "chosen", "rejected": "rejected", "completion": "completion (unpaired rows)",
    "label": "label (unpaired rows)", "completions": "completions list (ranked rows)",
    "scores": "scores list beside a plain completions list (ranked rows; higher is better)",
    "margin": "margin (pair rows: a number, how much the chosen reward must beat the rejected one by in a reward "
              "model's loss, TRL's margin column; rows without it get 0)",
    "spans": "loss_masking_spans (text rows: character ranges [start, end) of a completion that are not scored; "
             "pair rows {\"chosen\": [[s, e], ...], \"rejected\": [...]}, unpaired rows a list)",
}


@dataclass(frozen=True)
class Fields:
    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"
    completion: str = "completion"
    label: str = "label"
    completions: str = "completions"
    scores: str | None = None  # ranked rows with a plain list of completions: the list of their scores
    spans: str = "loss_masking_spans"  # text rows: unscored character ranges of the completions (``text_spans``)
    margin: str = "margin"  # pair rows: the reward model's target margin (``formats.read_margin``; optional)

    def to_json(self) -> dict:
        return dict(self.__dict__)


def resolve_fields(layout: str, overrides: dict[str, str | None]) -> Fields:
    """Default field names for a layout, with the user's overrides applied."""
    base = {"prompt": "text" if layout == "text-pairs" else FOREIGN_PROMPT_FIELDS.get(layout, "prompt")}
    base.update({k: v for k, v in overrides.items() if v})
    return Fields(**base)


def detect_layout(row: dict, overrides: dict[str, str | None]) -> tuple[str, str]:
    """Pick a layout from the keys and value types of one row; return it and a sentence explaining why."""
    f = Fields(**{k: v for k, v in overrides.items() if v})
    keys = set(row)
    has = lambda name: name in keys  # noqa: E731
    prompt_names = [overrides.get("prompt")] if overrides.get("prompt") else ["prompt", "text"]
    if has(f.chosen) and has(f.rejected):
        if has(RLAIFV_IMAGE) and has(RLAIFV_QUESTION) and not any(has(p) for p in prompt_names):
            return "rlaif-v", (f"fields {RLAIFV_IMAGE!r}, {RLAIFV_QUESTION!r}, {f.chosen!r}, {f.rejected!r} "
                               "(RLAIF-V: one image per row)")
        if not overrides.get("prompt") and isinstance(row.get("conversations"), list):
            return "sharegpt", f"fields 'conversations', {f.chosen!r}, {f.rejected!r} (ShareGPT, LLaMA-Factory)"
        if not overrides.get("prompt") and not any(has(p) for p in prompt_names) and has("instruction"):
            return "alpaca", f"fields 'instruction', {f.chosen!r}, {f.rejected!r} (alpaca, LLaMA-Factory)"
        for pname in prompt_names:
            if has(pname):
                if isinstance(row[pname], list):
                    return "messages", f"fields {pname!r} (message list), {f.chosen!r}, {f.rejected!r}"
                if whole_conversation(row[f.chosen]):
                    return "implicit", (f"field {pname!r} is a string but {f.chosen!r} and {f.rejected!r} are whole "
                                        "conversations (UltraFeedback-binarized): the prompt is their shared prefix, "
                                        f"and {pname!r} is not read")
                layout = "text-pairs" if pname == "text" else "pairs"
                return layout, f"fields {pname!r}, {f.chosen!r}, {f.rejected!r}"
        return "implicit", f"only {f.chosen!r} and {f.rejected!r}: the prompt is their shared prefix"
    pname = overrides.get("prompt") or "prompt"
    if has(pname) and has(f.completion) and has(f.label):
        return "unpaired", f"fields {pname!r}, {f.completion!r}, {f.label!r}"
    kto = overrides.get("prompt") or "messages"
    if has(kto) and has(f.label) and isinstance(row[kto], list):
        return "kto-messages", f"fields {kto!r}, {f.label!r}: the last message is the completion (LLaMA-Factory's KTO)"
    ranked = ranked_fields(row, overrides)
    if ranked is not None:
        rp, rc = ranked
        return "ranked", f"fields {rp!r}, {rc!r} (a list of scored completions)"
    raise InvalidRow(
        "unknown_layout",
        None,
        f"cannot detect the layout from the fields {sorted(keys)}; expected prompt/chosen/rejected, "
        "text/chosen/rejected, chosen/rejected, prompt/completion/label, prompt/completions (scored), "
        "conversations/chosen/rejected, messages/label or instruction/chosen/rejected. Force one with --format and "
        "name fields with --prompt-field, --chosen-field, --rejected-field, --completion-field, --label-field, "
        "--completions-field",
    )


def whole_conversation(value) -> bool:
    """A message list that opens with a user or system turn: a whole conversation, not a reply."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and \
        value[0].get("role") in ("user", "system")


def ranked_fields(row: dict, overrides: dict[str, str | None]) -> tuple[str, str] | None:
    """The (prompt, completions) fields of a ranked row, the named ones or the first known names it has."""
    prompts = [overrides["prompt"]] if overrides.get("prompt") else RANKED_PROMPT_FIELDS
    lists = [overrides["completions"]] if overrides.get("completions") else RANKED_COMPLETIONS_FIELDS
    p = next((name for name in prompts if name in row), None)
    c = next((name for name in lists if isinstance(row.get(name), list)), None)
    return None if p is None or c is None else (p, c)
