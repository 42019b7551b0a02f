"""Per-round prompt subsets (``rounds.prompts_per_round``): round r samples ``size`` of the source's prompts, so a
round does not sample again the prompts the policy just trained on (RLHFlow's iterative DPO: a slice of a large
prompt set per round).

The choice is a pure function of the seed, the round and the source's prompt rows (never of the process or the
rank), so a resumed run and every torchrun rank take the same rows. The prompts are shuffled once per pass by a
permutation seeded by (seed, pass) and cut into ``count // size`` slices of ``size``; round r takes slice
``r % slices`` of pass ``r // slices``. Within a pass no prompt repeats and the rounds cover all but the
``count % size`` prompts at the permutation's tail (the remainder), which the next pass, shuffled anew, mixes in.
The rows keep their source numbers, so the samples' ``row`` traces back to the prompt file.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from prefpack.generation.engine import GenerationError
from prefpack.generation.prompts import Prompt, PromptSource


@dataclass(frozen=True)
class PromptSubset:
    """Which part of the prompts one round samples: ``size`` prompts of round ``index``'s slice (seeded by ``seed``)."""

    size: int
    seed: int
    index: int

    def choose(self, rows: list[int], where: str = "the prompts") -> dict:
        """The record of this round's slice of ``rows`` (the source's prompt rows, in source order): its pass, slice,
        the remainder left out of the pass, and the rows taken, ascending."""
        count = len(rows)
        if self.size > count:
            raise GenerationError(f"rounds.prompts_per_round is {self.size} but {where} holds {count} prompts; "
                                  f"choose at most {count} (0 = every prompt each round)")
        slices = count // self.size
        sweep, part = divmod(self.index, slices)
        order = np.random.default_rng([self.seed, sweep]).permutation(count)
        taken = sorted(int(rows[i]) for i in order[part * self.size:(part + 1) * self.size])
        return {"size": self.size, "seed": self.seed, "of": count, "pass": sweep, "slice": part, "slices": slices,
                "left_out_of_pass": count % self.size, "rows": taken}


class SubsetPrompts(PromptSource):
    """The prompts of ``source`` whose rows a round's :class:`PromptSubset` takes, in source order, their rows
    unchanged; rows outside it are not tokenised (``PromptSource.only``)."""

    def __init__(self, source: PromptSource, subset: PromptSubset, where: str = "the prompts"):
        self.source, self.tok = source, source.tok
        self.record = subset.choose(source.rows(), where)
        source.only = frozenset(self.record["rows"])

    @property
    def notes(self) -> list[str]:
        return self.source.notes

    def __iter__(self) -> Iterator[Prompt]:
        return (p for p in self.source if p.row in self.source.only)

    def count(self) -> int:
        return len(self.record["rows"])

    def rows(self) -> list[int]:
        return list(self.record["rows"])

    def tokenizer_record(self) -> dict:
        return self.source.tokenizer_record()

    def chat_template_record(self) -> dict | None:
        return self.source.chat_template_record()

    def describe(self) -> dict:
        return {**self.source.describe(), "subset": self.record}

    def inputs(self) -> list[str]:
        return self.source.inputs()

    def content_sha256(self) -> dict[str, str]:
        return self.source.content_sha256()
