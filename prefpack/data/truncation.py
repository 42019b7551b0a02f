"""What `--max-length` did to the data, said out loud: how many prompts and completions it cut and by how many tokens,
and the minimum share of its prompt an example must keep (``--min-prompt-keep``).

A left cut that leaves a prompt its BOS and a colon is not an example any more, yet it trains (and looks like a
prompt many pairs share); so a cut below the minimum is refused like any bad row, and every cut is counted.

The policies (``prepare --truncation``; docs/data.md has the table), with P the prompt's tokens, C the longest
completion's (EOS included) and L ``--max-length``, applied only where P + C > L:

- ``prompt-left`` (default): the prompt loses its first tokens (BOS kept) until P + C = L, keeping at least one
  token after BOS; a cut keeping less than ``--min-prompt-keep`` of it is refused; if C alone leaves no room,
  every completion keeps its first L - P tokens.
- ``drop``: the row is dropped (``too_long``).
- ``trl-keep-start``: TRL 1.16's DPO and KTO default (``DataCollatorForPreference`` slices each prompt + completion
  to ``[:max_length]``; ``_prepare_dataset`` filters out rows with ``len(prompt_ids) >= max_length``): the prompt
  is never cut, every completion keeps its first L - P tokens, and a row with P >= L is dropped
  (``prompt_too_long``).
- ``llamafactory``: LLaMA-Factory's ``cutoff_len`` (``data/processor/pairwise.py`` and ``feedback.py`` with
  ``processor_utils.infer_seqlen``, hiyouga/LLaMA-Factory @ ff6d4d12eeb0): ``infer_seqlen(P, C, L)`` gives the
  prompt's and the completions' budgets, and the prompt keeps its first tokens (its end is cut) and every
  completion its first tokens.

TRL's deprecated ``keep_end`` is not offered: it slices prompt + chosen and prompt + rejected apart, so the two
completions of a pair see different prompts, which a store with one prompt per pair cannot hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefpack.data.formats import Fields, InvalidRow

# Half the prompt: the end of a conversation (the last turns, the question) survives a left cut of half of it; less
# than that and the completions answer text the model no longer sees. 0 allows any cut, 1 refuses every prompt cut.
DEFAULT_MIN_PROMPT_KEEP = 0.5
BELOW_MINIMUM = "prompt_cut_below_minimum"
TRUNCATION_POLICIES = ("prompt-left", "drop", "trl-keep-start", "llamafactory")
# Per policy, what a text far over --max-length keeps when it is cut before tokenising (tokenize._encode_bounded):
# a prompt's end (True) or its start (False); None: never cut early (llamafactory's budgets depend on whole lengths).
PROMPT_CUT_BEFORE_TOKENISING = {"prompt-left": True, "drop": True, "trl-keep-start": False, "llamafactory": None}


def infer_seqlen(source_len: int, target_len: int, cutoff_len: int) -> tuple[int, int]:
    """LLaMA-Factory's share of ``cutoff_len`` between a prompt (`source_len` tokens) and its longest completion
    (`target_len`), the same arithmetic as its ``processor_utils.infer_seqlen``: a completion under half the limit is
    kept whole; else a prompt under half the limit is kept whole; else both are cut in proportion to their lengths.
    Returns (prompt tokens kept, completion tokens kept)."""
    if target_len * 2 < cutoff_len:
        max_target = cutoff_len
    elif source_len * 2 < cutoff_len:
        max_target = cutoff_len - source_len
    else:
        max_target = int(cutoff_len * (target_len / (source_len + target_len)))
    target = min(max_target, target_len)
    return min(max(cutoff_len - target, 0), source_len), target


def check_prompt_keep(before: int, after: int, longest: int, limit: int, min_keep: float) -> None:
    """Refuse a prompt cut from `before` to `after` tokens that keeps less than `min_keep` of it (an InvalidRow: an
    error naming the row, or a counted skip with --skip-invalid); the field is filled in by the caller."""
    if after >= before or after >= min_keep * before:
        return
    raise InvalidRow(BELOW_MINIMUM, None, f"--max-length {limit} would cut the prompt from {before} to {after} tokens "
                     f"(keeping {percent(after / before)} of it; the longest completion has {longest} tokens), below "
                     f"--min-prompt-keep {min_keep:g}. Raise --max-length, lower --min-prompt-keep (0 allows any cut), "
                     "pass --truncation drop to drop over-long rows, or cut as a peer does (--truncation "
                     "trl-keep-start or llamafactory, docs/data.md)")


def percent(share: float) -> str:
    """A share as a whole percentage, but never a cut that kept something shown as 0%."""
    return "under 1%" if 0 < share < 0.005 else f"{share:.0%}"


def prompt_field(layout: str, fields: Fields) -> str:
    """The field a prompt came from, to name in an error (an implicit prompt is the shared start of two fields)."""
    return fields.chosen if layout == "implicit" else fields.prompt


@dataclass
class CutStats:
    """Cuts of one part (prompts, or completions): how many, tokens removed, the largest cut, the least kept share."""

    cut: int = 0
    tokens_removed: int = 0
    largest_cut: int = 0
    least_kept_share: float = 1.0

    def add(self, before: int, after: int) -> None:
        if after >= before:
            return
        self.cut += 1
        self.tokens_removed += before - after
        self.largest_cut = max(self.largest_cut, before - after)
        self.least_kept_share = min(self.least_kept_share, after / before)

    def merge(self, other: CutStats) -> None:
        self.cut += other.cut
        self.tokens_removed += other.tokens_removed
        self.largest_cut = max(self.largest_cut, other.largest_cut)
        self.least_kept_share = min(self.least_kept_share, other.least_kept_share)

    def to_json(self) -> dict:
        mean = round(self.tokens_removed / self.cut, 2) if self.cut else 0.0
        return {"cut": self.cut, "tokens_removed": self.tokens_removed, "mean_cut": mean,
                "largest_cut": self.largest_cut, "least_kept_share": round(self.least_kept_share, 4)}


@dataclass
class TruncationStats:
    """Prompt and completion cuts over a whole store (each ranked prompt counted once; each completion apart), the
    rows cut (a ranked prompt's group is one row), and the chat prompts among them cut inside a message."""

    prompts: CutStats = field(default_factory=CutStats)
    completions: CutStats = field(default_factory=CutStats)
    rows: int = 0
    chat_prompts: int = 0  # chat prompts cut by tokens: they start (or end) inside a message
    policy: str = "prompt-left"

    def merge(self, other: TruncationStats) -> None:
        self.prompts.merge(other.prompts)
        self.completions.merge(other.completions)
        self.rows += other.rows
        self.chat_prompts += other.chat_prompts

    def to_json(self) -> dict:
        return {"policy": self.policy, "rows_cut": self.rows,
                "tokens_removed": self.prompts.tokens_removed + self.completions.tokens_removed,
                "chat_prompts_cut": self.chat_prompts,
                "prompts": self.prompts.to_json(), "completions": self.completions.to_json()}


# where each policy cuts a prompt, and what that leaves of a chat prompt (rendered text, cut by tokens)
PROMPT_CUT = {"prompt-left": ("from the left", "starts inside a message, without its role header"),
              "llamafactory": ("at the end", "ends inside a message, without the generation prompt (as LLaMA-Factory "
                               "trains them)")}


def describe(stats: dict, max_length: int | None, estimated: int = 0) -> str | None:
    """One line for prepare's summary and `prefpack inspect` from ``to_json``'s dict; None when nothing was cut."""
    parts = []
    policy = stats.get("policy", "prompt-left")  # stores before the key: prompt-left, the only cut there was
    prompt_where, chat_note = PROMPT_CUT.get(policy, PROMPT_CUT["prompt-left"])
    for name, where in (("prompts", prompt_where), ("completions", "at the end")):
        s = stats.get(name) or {}
        if s.get("cut"):
            kept = f"; the most cut kept {percent(s['least_kept_share'])}" if name == "prompts" else ""
            parts.append(f"{name} cut {where}: {s['cut']:,} ({s['tokens_removed']:,} tokens removed: mean "
                         f"{s['mean_cut']:,.1f}, largest {s['largest_cut']:,}{kept})")
    if not parts:
        return None
    limit = f" --max-length {max_length}" if max_length else " --max-length"
    named = f" (--truncation {policy})" if policy != "prompt-left" else ""
    rows = f"{stats['rows_cut']:,} rows, {stats['tokens_removed']:,} tokens removed; " if "rows_cut" in stats else ""
    note = f" (estimated for {estimated} texts cut before tokenising)" if estimated else ""
    chat = stats.get("chat_prompts_cut", 0)
    chat = (f"; {chat:,} chat prompts were cut by tokens, not at a message boundary: each {chat_note}"
            if chat else "")
    return f"cut to{limit}{named}: {rows}" + "; ".join(parts) + note + chat
