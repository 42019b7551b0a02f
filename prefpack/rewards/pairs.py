"""Preference pairs from one prompt's scored samples (the on-policy rounds' selection; ``prefpack score --pairs``).

- ``best_vs_worst``: the best against the worst, one pair per prompt (RLHFlow's max-min);
- ``best_vs_rest``: the best against each sample scored lower;
- ``all_pairs``: every (higher, lower) ordered pair.

A pair whose score gap is at most ``min_gap`` is not a preference and is left out; a prompt left with no pair (all
its samples tie) is skipped and counted by :class:`PairSelection`. Ties among the best go to the first sample, as
``data.views.group_pairs`` breaks them, so with ``min_gap=0`` ``best_vs_rest`` and ``all_pairs`` draw exactly the
pairs a ranked store yields at train time under ``data.ranked_pairs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PAIR_MODES = ("best_vs_worst", "best_vs_rest", "all_pairs")


def best_vs_worst(scores: list[float], min_gap: float = 0.0) -> list[tuple[int, int]]:
    """[(best, worst)]: the first of the top scores against the last of the bottom ones; [] on a tie."""
    best = max(range(len(scores)), key=lambda i: (scores[i], -i))
    worst = min(range(len(scores)), key=lambda i: (scores[i], -i))
    return [(best, worst)] if scores[best] - scores[worst] > min_gap else []


def best_vs_rest(scores: list[float], min_gap: float = 0.0) -> list[tuple[int, int]]:
    best = max(range(len(scores)), key=lambda i: (scores[i], -i))
    return [(best, j) for j in range(len(scores)) if scores[best] - scores[j] > min_gap]


def all_pairs(scores: list[float], min_gap: float = 0.0) -> list[tuple[int, int]]:
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return [(i, j) for i in order for j in range(len(scores)) if scores[i] - scores[j] > min_gap]


SELECTORS = {"best_vs_worst": best_vs_worst, "best_vs_rest": best_vs_rest, "all_pairs": all_pairs}


@dataclass
class PairSelection:
    """Draws pairs prompt by prompt with one mode and gap, counting prompts, pairs and skipped (tied) prompts."""

    mode: str
    min_gap: float = 0.0
    prompts: int = 0
    pairs: int = 0
    tied: int = 0
    gaps: list[float] = field(default_factory=list)  # chosen - rejected score of each pair drawn

    def __post_init__(self):
        if self.mode not in SELECTORS:
            raise ValueError(f"pair mode must be one of {', '.join(PAIR_MODES)}, not {self.mode!r}")
        if not self.min_gap >= 0:
            raise ValueError(f"the minimum score gap must be >= 0, not {self.min_gap}")

    def __call__(self, scores: list[float]) -> list[tuple[int, int]]:
        self.prompts += 1
        chosen = SELECTORS[self.mode](list(scores), self.min_gap) if len(scores) > 1 else []
        self.tied += not chosen
        self.pairs += len(chosen)
        self.gaps.extend(scores[c] - scores[r] for c, r in chosen)
        return chosen

    def counts(self) -> dict:
        mean_gap = sum(self.gaps) / len(self.gaps) if self.gaps else None
        return {"mode": self.mode, "min_gap": self.min_gap, "prompts": self.prompts, "pairs": self.pairs,
                "tied_prompts": self.tied, "mean_gap": mean_gap}
