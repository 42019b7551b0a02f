"""KTO's KL partners: which other example's completion each example's prompt is scored with.

KTO compares each reward r = log pi(y|x) - log ref(y|x) with z0 = max(0, E[log pi(y'|x) - log ref(y'|x)]),
estimated on *mismatched* sequences: each example's prompt x with the completion y' of another example
(its "KL partner"). The pairing rule:

* ``loss.kl_pairing: step`` (default, as TRL): the partners come from the same optimizer step. The step's
  examples are grouped by prompt (examples with identical prompt tokens, such as the two halves of a pair
  read as KTO, form one group: prompt + a completion of the same prompt is a real example, not a mismatched
  one), the groups are put in one random cycle seeded by ``(train.seed, step)``, and each example takes a
  completion from the next group of the cycle. So a partner is never the example itself, nor an example with
  the same prompt while the step holds another prompt, for any step size (odd ones included). The pairing
  is computed over the whole scheduled step, even when a rank plans only its share of it under torchrun,
  so it does not depend on packing, micro-batching, the number of ranks or the dealing: N ranks give the
  update of one process. A step with a single group (one example, the two halves of one pair, or a single
  prompt) has no mismatched completion: its examples take their partner from the fixed pairing below (a
  deterministic other example of the store, with another prompt when the store has one, possibly outside
  the step).
* ``loss.kl_pairing: fixed``: one seeded cycle over the prompt groups of the whole store (seed
  ``train.seed``); each example has the same partner in every step. This is what a precomputed reference
  needs: the sidecar can hold an example's reference KL log-prob only if its partner does not depend on the
  step. Evaluation passes (``prefpack eval``, ``data.eval``) always use this pairing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["SALT_FIXED", "SALT_STEP", "cycle_partners", "fixed_kl_partners", "step_kl_partners"]

SALT_FIXED = 0x4B4C_0001  # separate random streams for the pairings and the packing order
SALT_STEP = 0x4B4C_0002


def cycle_partners(ids: np.ndarray, groups: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A KL partner for each of ``ids``, taken among ``ids``: the groups present are put in one random cycle
    and each example takes a random member of the next group. Never the example itself, never its group.
    All -1 when ``ids`` span fewer than two groups (no valid partner among them)."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size == 0:
        return ids.copy()
    uniq, slot = np.unique(groups[ids], return_inverse=True)
    n_groups = len(uniq)
    if n_groups < 2:
        return np.full(ids.shape[0], -1, dtype=np.int64)
    order = rng.permutation(n_groups)
    nxt = np.empty(n_groups, dtype=np.int64)
    nxt[order] = np.roll(order, -1)  # order[k] -> order[k + 1]: one cycle, no fixed point
    by_slot = np.argsort(slot, kind="stable")
    counts = np.bincount(slot, minlength=n_groups)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    target = nxt[slot]
    pick = starts[target] + rng.integers(0, counts[target])
    return ids[by_slot[pick]]


def fixed_kl_partners(groups: np.ndarray, seed: int) -> np.ndarray:
    """The store-level pairing: :func:`cycle_partners` over every example, seeded by ``seed`` only.

    With a single group of several examples (one pair as KTO) the halves are paired with each other; with a
    single example there is no partner (-1)."""
    n = int(groups.shape[0])
    ids = np.arange(n, dtype=np.int64)
    out = cycle_partners(ids, groups, np.random.default_rng([int(seed), SALT_FIXED]))
    if n >= 2 and (out < 0).any():
        out = np.roll(ids, -1)  # one group only: another member of it is the only other completion
    return out


def step_kl_partners(ids: np.ndarray, groups: np.ndarray, key: Sequence[int],
                     fallback: np.ndarray | None) -> np.ndarray:
    """Partners of a step's examples inside the step (see the module docstring); ``key`` seeds the cycle.

    Where the step spans fewer than two groups, ``fallback[ids]`` (the fixed store-level pairing) is used."""
    out = cycle_partners(ids, groups, np.random.default_rng([int(k) for k in key]))
    if ids.size and (out < 0).any() and fallback is not None:
        out = fallback[np.asarray(ids, dtype=np.int64)]
    return out
