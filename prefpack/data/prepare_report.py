"""What ``prepare`` reports: the counts of one run and their summary, the lines a user reads after it (kept apart
from the pipeline in ``prepare``, which only fills it in)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from prefpack.data.store_format import grouping_pays
from prefpack.data.truncation import describe

__all__ = ["PrepareReport"]


@dataclass
class PrepareReport:
    path: Path
    layout: str
    layout_reason: str
    examples: int
    tokens: int
    rows_read: int
    skipped: dict[str, int]
    dropped: dict[str, int]
    truncated: dict[str, int]
    seconds: float
    empty_completions: dict[str, int] = field(default_factory=dict)
    chat: dict[str, int] = field(default_factory=dict)  # "examples" rendered by the chat template, "with_tools"
    groups: int | None = None  # ranked stores: prompts (each with several completions, the examples)
    repeated_prompts: dict[str, int] = field(default_factory=dict)  # pair stores: {"prompts": n, "pairs": m}
    unused_columns: list[str] = field(default_factory=list)  # input columns prepare did not read
    spans: int = 0  # unscored token ranges stored (spans.bin)
    cuts: dict = field(default_factory=dict)  # TruncationStats.to_json(): prompts and completions cut, tokens removed
    max_length: int | None = None
    images: int = 0  # images stored (images.bin)
    left_out: dict = field(default_factory=dict)  # {"rows": n, "first": "where: what"}: reply text not rendered
    null_keys: dict = field(default_factory=dict)  # {"keys": n, "rows": m}: Arrow's null keys dropped (arrow_rows)
    margins: int = 0  # pair rows that gave a margin (margins.bin)
    margin_field: str = "margin"

    def summary(self) -> str:
        what = f"{self.examples} examples" if self.groups is None else \
            f"{self.groups} prompts with {self.examples} scored completions"
        lines = [
            f"wrote {self.path}: {what}, {self.tokens} tokens from {self.rows_read} rows "
            f"in {self.seconds:.1f}s ({self.tokens / max(self.seconds, 1e-9):,.0f} tokens/s)",
        ]
        if self.skipped:
            lines.append("skipped (invalid): " + ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items()))
                         + f"; every skipped row is in {self.path / 'skipped.jsonl'}")
        if self.repeated_prompts.get("prompts"):
            r = self.repeated_prompts
            uncut = " (prompts --max-length cut are not counted)" if (self.cuts.get("prompts") or {}).get("cut") else ""
            advice = (": train with data.group_by_prompt=true to compute each such prompt, and each completion "
                      "repeated in its pairs, once (a prompt's pairs then share a step); by default every pair "
                      "computes its own") if grouping_pays(r["pairs"], self.examples) else \
                " (too few to be worth data.group_by_prompt)"
            lines.append(f"{r['pairs']} pairs share {r['prompts']} prompts with other pairs{uncut}{advice}")
        if self.dropped:
            lines.append("dropped (length policy): " + ", ".join(f"{k}={v}" for k, v in sorted(self.dropped.items())))
        cut = describe(self.cuts, self.max_length, self.truncated.get("cut_before_tokenising", 0))
        if cut:  # the examples cut (self.truncated, in meta.json) told apart by part and tokens
            lines.append(cut)
        if self.empty_completions:
            lines.append("kept empty or whitespace-only completions (each is its whitespace then EOS, as TRL "
                         "trains them): " + ", ".join(f"{k}={v}" for k, v in sorted(self.empty_completions.items())))
        if self.null_keys.get("keys"):
            lines.append(f"null keys dropped: {self.null_keys['keys']} in {self.null_keys['rows']} rows (Parquet / "
                         "datasets fill every message, tool call and tool schema with the other rows' keys as null; "
                         "they are dropped before rendering, docs/data.md)")
        if self.images:
            lines.append(f"images: {self.images} stored with their placeholders expanded to the processor's token "
                         "counts (images.bin); train a vision-language model on them (docs/images.md)")
        if self.spans:
            lines.append(f"unscored spans: {self.spans} token ranges inside completions get no loss (spans.bin; "
                         "`prefpack inspect --row N` shows them)")
        if not self.margins and self.margin_field != "margin":  # named, and no row holds it: a misspelt field?
            lines.append(f"warning: --margin-field {self.margin_field!r}: no row holds it, so the store holds no "
                         "margins (check the field's name)")
        if self.margins:
            lines.append(f"margins: {self.margins} of {self.examples} pairs give a {self.margin_field!r} (margins.bin, "
                         "store version 4; 0 for the others): a reward model's loss reads them "
                         "(-logsigmoid(r_chosen - r_rejected - margin), docs/reward-models.md)")
        if self.left_out.get("rows"):
            lines.append(f"left out by the chat template: text of {self.left_out['rows']} rows' replies is not in "
                         f"their rendering, so it is not trained on (first: {self.left_out['first']})")
        unread = {k.split(":", 1)[1]: n for k, n in self.chat.items() if k.startswith("unread:")}
        if unread:  # a row's chat_template_kwargs the template never reads: passed, with no effect
            lines.append("chat_template_kwargs the chat template never reads (no effect): "
                         + ", ".join(f"{k!r} in {n} rows" for k, n in sorted(unread.items())))
        if self.chat.get("prompt_at_difference"):
            lines.append(f"implicit prompts without chat markers: {self.chat['prompt_at_difference']} rows' prompts are "
                         "chosen and rejected's common prefix, cut where they first differ (TRL's extract_prompt); "
                         "give a prompt column to choose it yourself")
        if self.chat.get("split_rows"):
            lines.append(f"scored turn by turn: {self.chat['split_rows']} rows' replies became "
                         f"{self.chat['split_sequences']} more sequences after their prompts, where the chat template "
                         "rewrites earlier turns (each turn in the context the model saw; segments.bin)")
        if self.chat.get("with_tools"):
            lines.append(f"rendered with tools: {self.chat['with_tools']} of {self.chat.get('examples', 0)} chat "
                         "examples")
        if self.chat.get("with_documents"):
            lines.append(f"rendered with documents: {self.chat['with_documents']} of {self.chat.get('examples', 0)} "
                         "chat examples")
        return "\n".join(lines)
