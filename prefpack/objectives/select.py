"""Which objective a config trains, its stores, and the train and eval objectives built for a loaded model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from prefpack.data.store import Store, StoreError
from prefpack.objectives.base import Objective
from prefpack.objectives.groups import PromptGroupTask
from prefpack.objectives.mixture import MixtureObjective
from prefpack.objectives.names import OBJECTIVE_NAMES
from prefpack.objectives.registry import objective_for, trains_unpaired
from prefpack.objectives.settings import RunSettings
from prefpack.reference import PrecomputedReference, Reference, ReferenceMismatch

__all__ = ["make_objectives", "open_store", "uses_unpaired_loss"]

_STEP_PAIRING_PRECOMPUTED = (
    "reference.mode 'precomputed' with loss 'kto' needs loss.kl_pairing=fixed: with step pairing an example's "
    "KL partner depends on which examples share its optimizer step, so no sidecar can hold its reference KL "
    "log-prob; fixed pairing gives every example one seeded partner that precompute-ref scores once")


def uses_unpaired_loss(cfg) -> bool:
    """Whether a config trains the KTO family (an unpaired loss term, or a pair store read as KTO)."""
    return trains_unpaired(cfg.loss.terms, paired_as_kto=cfg.data.paired_as_kto)


def open_store(path: str, what: str, *, unpaired: bool, paired_as_kto: bool = False) -> Store:
    """Open a train/eval store for the objective: pairs for the DPO family, unpaired examples (or pairs read as
    KTO with ``paired_as_kto``) for the KTO family. Token ids are checked once here, so a damaged store fails
    now, by name, not with an IndexError in some later step."""
    store = Store(path)
    store.check_token_ids()
    if unpaired and store.kind == "pairs" and not paired_as_kto:
        raise StoreError(f"{what} store {path!r} holds pairs; set data.paired_as_kto=true to train KTO on it "
                         "(chosen = desirable, rejected = undesirable), or use a store prepared with "
                         "--format unpaired")
    if unpaired and store.kind == "ranked":
        raise StoreError(f"{what} store {path!r} holds ranked completions, which pair losses train on; KTO on "
                         "them is not supported (prepare the rows as --format unpaired with a label each)")
    if not unpaired and store.kind not in ("pairs", "ranked"):
        raise StoreError(f"{what} store {path!r} holds unpaired examples (KTO); the DPO-family trainer needs pairs "
                         "(train it with loss.terms=[{name: kto}] or apo_zero_unpaired)")
    if len(store) == 0:
        raise StoreError(f"{what} store {path!r} is empty")
    return store


def make_objectives(settings: RunSettings, terms: Sequence, train_store: Store | Sequence[tuple[str, Store]],
                    eval_store: Store | Sequence[Store] | None, reference: Reference, *, kto: bool,
                    group_by_prompt: bool = False, objective: str = OBJECTIVE_NAMES[0],
                    log=print) -> tuple[Objective, Any]:
    """The train and eval objectives of a run (``kto``: the KTO family). ``train_store`` may be a mixture, a list of
    ``(name, store)``: its objective is a :class:`MixtureObjective` over each store's own. ``eval_store`` may be a
    list of stores: then the eval objectives are a list too. A precomputed reference loads each store's sidecar
    here, by the objective's key space (the KTO one tagged with its KL pairing). ``objective``: the run's
    ``train.objective``, whose row (``names.TRAIN_OBJECTIVES``) names the classes for each store layout."""
    evals = list(eval_store) if isinstance(eval_store, list | tuple) else [eval_store] if eval_store else []
    mixture = not isinstance(train_store, Store)
    named = list(train_store) if mixture else [("", train_store)]
    stores = [s for _, s in named] + evals
    objectives = [objective_for(s.kind, unpaired=kto, group_by_prompt=group_by_prompt,
                                objective=objective).make(s, settings, terms) for s in stores]
    if kto:
        warning = objectives[0].class_balance_warning()
        if warning:
            log(f"warning: {warning}")
        if isinstance(reference, PrecomputedReference) and objectives[0].needs_kl and \
                settings.loss.kl_pairing != "fixed":
            raise ReferenceMismatch(_STEP_PAIRING_PRECOMPUTED)
    else:
        for o in objectives:
            note = o.run_note() if isinstance(o, PromptGroupTask) else None
            if note:
                log(f"note: {note}")
    for o in objectives[:len(named)]:
        for warning in batch_warnings(o, whole_store_steps=not mixture):
            log(f"warning: {warning}")
    if isinstance(reference, PrecomputedReference):  # each store's sidecar, read by the objective's keys
        ld = not kto and settings.loss.ld_alpha is not None
        for o in objectives:
            space = o.key_space()
            if ld and not space.tails:
                raise ReferenceMismatch(
                    f"store {str(o.store.path)!r} holds ranked completions and loss.ld_alpha (LD-DPO) needs the "
                    "reference's sums past the shorter completion of each pair, which a ranked sidecar does not "
                    "hold (it has one sum per completion, whatever pairs it is in): use reference.mode=copy (or "
                    "adapter) with LD-DPO on a ranked store")
            reference.load(o.store, space, need_tails=ld)
    train = objectives[:len(named)]
    for o in objectives[len(named):]:
        o.as_evaluation()
    task = MixtureObjective([n for n, _ in named], train) if mixture else train[0]
    if isinstance(eval_store, list | tuple):
        return task, objectives[len(named):]
    return task, objectives[len(named)] if evals else None


def batch_warnings(task: Objective, *, whole_store_steps: bool = True) -> list[str]:
    """What the batch sizes would do silently on this training store, with the numbers: a step larger than the
    store (each step takes all of it), and a micro-batch budget smaller than examples (each such one is a
    micro-batch of its own, over the budget)."""
    out, n, s = [], len(task), task.settings
    path = str(task.store.path)
    if whole_store_steps and s.global_batch > n:
        out.append(f"train.global_batch_pairs={s.global_batch} is larger than the training store {path!r}, which "
                   f"gives {n} examples: every step takes the whole store ({n} per step, one step per epoch). "
                   f"Lower train.global_batch_pairs to at most {n}")
    cost = np.asarray(task.example_tokens(np.arange(n)))
    over = int((cost > s.micro_batch_tokens).sum())
    if over:
        budget = f"(auto: {s.micro_batch_tokens})" if s.micro_batch_auto else f"={s.micro_batch_tokens}"
        out.append(f"train.micro_batch_tokens{budget} is smaller than {over} of the {n} examples of "
                   f"{path!r} (they take {int(cost.min())} to {int(cost.max())} tokens): each of those is a "
                   f"micro-batch of its own, over the budget. "
                   + (f"auto sized it for this device: set train.micro_batch_tokens={int(cost.max())} or more if "
                      "memory allows, or prepare shorter rows (prepare --max-length)" if s.micro_batch_auto else
                      f"Raise it to at least {int(cost.max())}, or leave it auto"))
    return out
