"""What each optimizer step trains on: a :class:`Feed`. The loop asks the feed for step ``k``'s objective and
examples and reads its step count for the learning-rate schedule; it never reads the data config itself.

:class:`StoreFeed` is the feed of prepared stores: one store or a mixture (``data.train``), a seeded per-epoch
schedule, ``train.max_steps`` / ``train.epochs`` steps. Its data position is a pure function of the step, so its
state for resume is only what the objective carries across steps (BCO's running mean). A feed whose examples are
made during training (on-policy rounds: ``prefpack.rounds.feed.RolloutFeed``) answers the same protocol: it makes
a segment's examples at the segment's first step (the policy as the loop holds it then), asks for an evaluation and a
checkpoint at each segment's end (``boundary``), and records a finished segment after that (``step_done``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import numpy as np
from torch import nn

from prefpack.batching.mixture import MixtureSchedule
from prefpack.batching.schedule import StepKey, StepSchedule
from prefpack.config.mixture import eval_sources, is_mixture, train_sources
from prefpack.data.store import Store, StoreError
from prefpack.data.views import row_lengths
from prefpack.engine import Engine
from prefpack.losses import BATCH_COUPLED_LOSSES
from prefpack.model import KERNELS, ModelError, is_vision_language, kernel_of, router_aux_loss_coef
from prefpack.objectives import (
    Objective,
    RunSettings,
    config_terms,
    make_objectives,
    open_store,
    settings_from_config,
)
from prefpack.remote_code import check_processor_code
from prefpack.training.mixture import describe_mixture, make_schedule

__all__ = ["Feed", "FeedStep", "StoreFeed", "StoreSet", "check_lengths", "open_stores", "run_images", "store_feed",
           "total_steps"]


@dataclass
class FeedStep:
    """One step's work: the objective, its examples, the step's seed key and where it stands in epochs;
    ``metrics``: fields the feed adds to the step's metrics line (a round's number); ``reset_optimizer``: the
    optimizer's state is cleared before this step (``rounds.optimizer: reset``)."""

    objective: Objective
    ids: np.ndarray
    key: StepKey
    epoch: float
    metrics: dict[str, Any] = field(default_factory=dict)
    reset_optimizer: bool = False


class Feed(Protocol):
    """What the loop trains on, step by step: everything the loop reads of it."""

    num_steps: int  # the steps the loop runs and the learning-rate schedule spans (rounds: count x steps_per_round)
    moves_reference: bool  # the feed changes a copied reference between steps: checkpoints keep it
    reads_images: bool  # whether the next step's images are read ahead
    eval_tasks: dict[str, Objective]  # data.eval's objectives by name (read at each evaluation)

    def forward_options(self) -> dict: ...  # what the policy forward returns (read once, before the first step)

    def begin(self, start: int, metrics) -> None: ...  # before step ``start`` (after a resume), with the run's logger

    def step(self, k: int) -> FeedStep | None: ...  # None: no work at step k (its learning rate passes unused)

    def boundary(self, done: int) -> bool: ...  # after step ``done``: evaluate and checkpoint (a segment ended)

    def step_done(self, done: int, evaluation: dict | None) -> None: ...  # after each step's evaluation and checkpoint

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def total_steps(cfg, sched: StepSchedule | MixtureSchedule) -> int:
    if cfg.train.max_steps is not None:
        return int(cfg.train.max_steps)
    return max(1, math.ceil(cfg.train.epochs * sched.steps_per_epoch))


@dataclass
class StoreFeed:
    """Steps over prepared stores (see the module doc); ``eval_tasks``: every eval store's objective by name."""

    objective: Objective
    schedule: StepSchedule | MixtureSchedule
    num_steps: int
    seed: int
    settings: RunSettings
    eval_tasks: dict[str, Objective] = field(default_factory=dict)
    moves_reference = False

    @property
    def reads_images(self) -> bool:
        return self.settings.vision is not None

    def forward_options(self) -> dict:
        return self.objective.forward_options()

    def begin(self, start: int, metrics) -> None:
        return None

    def step(self, k: int) -> FeedStep:
        epoch, ids = self.schedule.pairs_for_step(k)
        per_epoch = self.schedule.steps_per_epoch
        return FeedStep(self.objective, ids, StepKey(self.seed, k), epoch + (k % per_epoch + 1) / per_epoch)

    def boundary(self, done: int) -> bool:
        return False  # the run's cadence (run.eval_every, run.save_every) alone

    def step_done(self, done: int, evaluation: dict | None) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return self.objective.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.objective.load_state_dict(state)


@dataclass
class StoreSet:
    """A run's stores, opened and checked for its objective before any model loads."""

    specs: list  # data.train's sources (one for a single store)
    train: list[tuple[str, Store]]
    evals: dict[str, Store]

    def every(self) -> list[tuple[str, Store]]:
        """Each store with the name errors give it."""
        return [("train", st) for _, st in self.train] + [(f"data.eval{'.' + n if n else ''}", st)
                                                          for n, st in self.evals.items()]


def open_stores(cfg, *, unpaired: bool, train: bool = True) -> StoreSet:
    """Every store of ``data.train`` (a mixture: several, each under its name; none with ``train=False``: a feed
    that makes its own) and ``data.eval``, opened for the objective family (``unpaired``: the KTO family)."""
    opener = partial(open_store, unpaired=unpaired, paired_as_kto=cfg.data.paired_as_kto)
    specs = train_sources(cfg.data.train) if train else []
    train = [(spec.name, opener(spec.path, "train")) for spec in specs]
    evals = {name: opener(path, "eval") for name, path in eval_sources(cfg.data.eval).items()}
    stores = StoreSet(specs, train, evals)
    for what, store in stores.every():  # a processor/ naming code, refused before the model loads
        if store.num_images:
            check_processor_code(store.path / "processor", allowed=cfg.model.trust_remote_code,
                                 what=f"{what} store's processor folder")
    return stores


def store_feed(cfg, stores: StoreSet, engine: Engine, *, pad_id: int, log=print) -> StoreFeed:
    """The feed of a run's stores, for the weights as the engine holds them: prompt sharing for its kernel, lengths
    checked against its positions and budgets, images expanded for it, the MoE coefficient, and the objectives."""
    policy, budgets = engine.policy, engine.budgets
    kto = engine.unpaired
    terms = [] if kto else [t.name for t in cfg.loss.terms]
    coupled = [t for t in terms if t in BATCH_COUPLED_LOSSES]
    if coupled:
        log(f"note: {', '.join(coupled)} couple the pairs of one micro-batch (as TRL's do within one forward pass), "
            "so their values depend on which pairs share a micro-batch (train.micro_batch_tokens)")
    shares_prompts = prefix_sharing(cfg.data, policy)
    if shares_prompts:
        log("each prompt laid out once per prompt group in packed rows (data.prefix_sharing)")
    for what, store in [("train", st) for _, st in stores.train] + [("eval", st) for st in stores.evals.values()]:
        check_lengths(store, what, policy, budgets.row_tokens if cfg.data.packing else None, log)
    coef = moe_coefficient(cfg, policy, kto=kto, log=log)
    vision = run_images(policy, stores.every(), trust_remote_code=cfg.model.trust_remote_code)
    settings = settings_from_config(cfg, pad_id=pad_id, micro_batch_tokens=budgets.micro_batch_tokens,
                                    row_tokens=budgets.row_tokens, chunk_size=budgets.chunk_size,
                                    shares_prompts=shares_prompts, router_aux_loss_coef=coef, vision=vision)
    train_store = stores.train if is_mixture(cfg.data.train) else stores.train[0][1]
    task, eval_list = make_objectives(settings, config_terms(cfg), train_store, list(stores.evals.values()),
                                      engine.reference, kto=kto, group_by_prompt=cfg.data.group_by_prompt,
                                      objective=cfg.train.objective, log=log)
    for line in describe_mixture(cfg, task):
        log(line)
    schedule = make_schedule(cfg, task)  # one store, or a mixture (data.train as a list)
    return StoreFeed(task, schedule, total_steps(cfg, schedule), cfg.train.seed, settings,
                     dict(zip(stores.evals, eval_list)))


def moe_coefficient(cfg, policy: nn.Module, *, kto: bool, log) -> float:
    """``loss.router_aux_loss_coef`` resolved, TRL's rule: null = the model config's coefficient, added only for MoE
    models, and to pair losses only."""
    if kto:
        if cfg.loss.router_aux_loss_coef:
            raise ModelError("loss.router_aux_loss_coef: the MoE load-balancing loss is added to pair losses only, "
                             "not to KTO's; leave it null or 0")
        return 0.0
    try:
        coef = router_aux_loss_coef(policy, cfg.loss.router_aux_loss_coef)
    except ValueError as e:
        raise ModelError(str(e)) from None
    if coef:
        log(f"MoE router load-balancing loss added with weight {coef:g} (loss.router_aux_loss_coef)")
    return coef


def run_images(model: nn.Module, stores: list[tuple[str, Store]], *, trust_remote_code: bool = False):
    """The run's ``VisionSettings`` (None when no store holds images): one image processor over every image store,
    each store's images expanded for this model (its image token and patch grid), and a vision-language model."""
    from prefpack.data.vision_inputs import run_vision
    from prefpack.model.vision import check_processor, vision_parts

    parts = vision_parts(model) if is_vision_language(model) else None

    def check(processor: dict, where: str) -> None:
        try:
            check_processor(model, processor, where)
        except ValueError as exc:
            raise StoreError(str(exc)) from None

    return run_vision(stores, parts, check, trust_remote_code=trust_remote_code)


def prefix_sharing(data_cfg, policy: nn.Module) -> bool:
    """``data.prefix_sharing`` resolved: prompt-shared rows need packing and a kernel that reads
    prompt groups (its descriptor says so). ``auto`` is on where the descriptor says sharing was measured faster
    (``prefix_sharing_auto``); ``true`` runs on any reader and elsewhere is an error naming what is missing."""
    setting = data_cfg.prefix_sharing
    if not setting:
        return False
    kernel = kernel_of(policy)
    if setting == "auto":
        return data_cfg.packing and kernel.prefix_sharing_auto  # pair and KTO objectives alike
    if not data_cfg.packing:
        raise ModelError("data.prefix_sharing lays prompts out once in packed rows; with data.packing=false there are "
                         "none: set one of them false")
    if not kernel.reads_prompt_groups:
        readers = [k for k in KERNELS if k.reads_prompt_groups]
        raise ModelError(f"data.prefix_sharing needs an attention kernel that reads prompt groups from position ids "
                         f"({' or '.join(f'{k.name} on {k.where}' for k in readers)}); this run uses "
                         f"{kernel.name or 'another kernel'!r}. Set data.prefix_sharing=false, or "
                         f"model.attn_implementation={' / '.join(f'{k.name} ({k.where})' for k in readers)}")
    return True


def check_lengths(store: Store, what: str, model: nn.Module, row_budget: int | None, log) -> None:
    """Refuse sequences longer than the model's positions (they would fail or silently extrapolate), and say
    once how many examples are longer than a packed row (each of those gets a row of its own)."""
    longest, example, unit = row_lengths(store)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and limit > 0 and int(longest.max()) > limit:
        n = int((longest > limit).sum())
        raise ModelError(f"{what} store {str(store.path)!r}: {n} of {len(store)} {unit} have a sequence longer than "
                         f"the model's max_position_embeddings ({limit}; the longest has {int(longest.max())} "
                         f"tokens); prepare the data again with `prefpack prepare ... --max-length {limit}`")
    if row_budget is not None:
        n = int((example > row_budget).sum())
        if n:
            log(f"note: {n} of {len(store)} {unit} in the {what} store are longer than a row "
                f"(data.max_tokens_per_row={row_budget}); each of them gets a row of its own")
