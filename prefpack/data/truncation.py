"""What `--max-length` did to the data, said out loud: how many prompts and completions it cut and by how many tokens,
and the minimum share of its prompt an example must keep (``--min-prompt-keep``).

A left cut that leaves a prompt its BOS and a colon is not an example any more, yet it trains (and looks like a
prompt many pairs share); so a cut below the minimum is refused like any bad row, and every cut is counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefpack.data.formats import Fields, InvalidRow

# Half the prompt: the end of a conversation (the last turns, the question) survives a left cut of half of it; less
# than that and the completions answer text the model no longer sees. 0 allows any cut, 1 refuses every prompt cut.
DEFAULT_MIN_PROMPT_KEEP = 0.5
BELOW_MINIMUM = "prompt_cut_below_minimum"


def check_prompt_keep(before: int, after: int, longest: int, limit: int, min_keep: float) -> None:
    """Refuse a prompt cut from `before` to `after` tokens that keeps less than `min_keep` of it (an InvalidRow: an
    error naming the row, or a counted skip with --skip-invalid); the field is filled in by the caller."""
    if after >= before or after >= min_keep * before:
        return
    raise InvalidRow(BELOW_MINIMUM, None, f"--max-length {limit} would cut the prompt from {before} to {after} tokens "
                     f"(keeping {percent(after / before)} of it; the longest completion has {longest} tokens), below "
                     f"--min-prompt-keep {min_keep:g}. Raise --max-length, lower --min-prompt-keep (0 allows any cut), "
                     "or pass --truncation drop to drop over-long rows")


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
    """Prompt and completion cuts over a whole store (each ranked prompt counted once; each completion apart)."""

    prompts: CutStats = field(default_factory=CutStats)
    completions: CutStats = field(default_factory=CutStats)

    def merge(self, other: TruncationStats) -> None:
        self.prompts.merge(other.prompts)
        self.completions.merge(other.completions)

    def to_json(self) -> dict:
        return {"prompts": self.prompts.to_json(), "completions": self.completions.to_json()}


def describe(stats: dict, max_length: int | None, estimated: int = 0) -> str | None:
    """One line for prepare's summary and `prefpack inspect` from ``to_json``'s dict; None when nothing was cut."""
    parts = []
    for name, where in (("prompts", "from the left"), ("completions", "at the end")):
        s = stats.get(name) or {}
        if s.get("cut"):
            kept = f"; the most cut kept {percent(s['least_kept_share'])}" if name == "prompts" else ""
            parts.append(f"{name} cut {where}: {s['cut']:,} ({s['tokens_removed']:,} tokens removed: mean "
                         f"{s['mean_cut']:,.1f}, largest {s['largest_cut']:,}{kept})")
    if not parts:
        return None
    limit = f" --max-length {max_length}" if max_length else " --max-length"
    note = f" (estimated for {estimated} texts cut before tokenising)" if estimated else ""
    return f"cut to{limit}: " + "; ".join(parts) + note
