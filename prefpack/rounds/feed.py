"""The rounds as a :class:`~prefpack.training.feed.Feed`: the training loop runs every round's steps in one process,
with one engine (the policy loaded once), one optimizer and one learning-rate schedule, and this feed makes each
round's examples at the round's first step.

At round ``r``'s first step the policy the loop holds is the round's policy: it samples the round's prompts
(``rounds.sampler``: in memory, nothing read back from disk, or live vLLM servers given these weights), the samples
are scored and the round's pair store written (the same files as the round driver's, which stay the resume record:
``plan``'s layout), and the round's objective is built over that store for the weights as the engine holds them. At
the round's last step the loop evaluates and checkpoints (``boundary``; with ``rounds.save_each_round``), then the
feed records the round (``step_done``): the round's model exported to ``rounds/NNN/train/final``, its phases'
seconds, its metrics line and ``round.json``. A resume from a round's closing checkpoint whose record is missing
records it first (``begin``), reading that step's evaluation back from the run's metrics; a resume from an earlier
checkpoint replays the rounds after it from their stores and records them again.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from prefpack.rounds import plan
from prefpack.rounds.metrics import ROUND_FILE, read_json, record_phase
from prefpack.rounds.sampler import RoundSampler, export_policy
from prefpack.training.feed import FeedStep, StoreSet, open_stores, store_feed

__all__ = ["RolloutFeed"]


class RolloutFeed:
    """Steps ``r * S .. (r + 1) * S - 1`` train on round ``r``'s pair store (``S = rounds.steps_per_round``), made at
    step ``r * S`` by the policy in memory. ``ranks``: the rounds' waits under torchrun; ``stop_at``: the driver's
    test hook (round, phase, count)."""

    reads_images = False

    def __init__(self, cfg, run_dir: Path, stores: StoreSet, engine, *, pad_id: int, tokenizer, ranks, log,
                 stop_at: tuple[int, str, int] | None = None):
        self.cfg, self.run_dir, self.stores, self.engine = cfg, Path(run_dir), stores, engine
        self.pad_id, self.tokenizer, self.ranks, self.log, self.stop_at = pad_id, tokenizer, ranks, log, stop_at
        rc = cfg.rounds
        self.per_round = rc.steps_per_round
        self.num_steps = rc.count * rc.steps_per_round
        self.moves_reference = rc.reference == "round_start" and engine.reference.model is not None
        self.each_round = rc.save_each_round  # false: online training, only the last round's model exported
        self.start = 0  # the step this process began at (rounds after it are recorded again when replayed)
        self.scorer = None  # the rounds' scorer, made once (a reward model loaded once; rank 0)
        self.metrics = None
        self.round: int | None = None  # the round whose steps run now
        self.feed = None  # its StoreFeed (None: its samples all tied)
        self.eval_feed = None  # the last StoreFeed built: data.eval's objectives
        self.started: float | None = None  # when this process started the round's training
        self.eval_scores: list[float] | None = None  # the round's held-out prompts' rewards (rank 0)
        self.overlap = rc.overlap  # round r + 1 sampled (from round r's starting policy) while round r trains
        self.sampler = RoundSampler(cfg, run_dir, engine, pad_id=pad_id, tokenizer=tokenizer, log=log)
        self._state: dict[str, Any] = {}

    # ------------------------------------------------------------------------------------------ what the loop reads

    def forward_options(self) -> dict:
        """The round objective's options from the settings alone: the forward is wrapped before round 1's store
        exists."""
        from prefpack.objectives import settings_from_config
        from prefpack.objectives.registry import objective_for
        from prefpack.training.feed import moe_coefficient

        b = self.engine.budgets
        coef = moe_coefficient(self.cfg, self.engine.policy, kto=False, log=lambda *_: None)
        settings = settings_from_config(self.cfg, pad_id=self.pad_id, micro_batch_tokens=b.micro_batch_tokens,
                                        row_tokens=b.row_tokens, chunk_size=b.chunk_size, shares_prompts=False,
                                        router_aux_loss_coef=coef)
        round_cfg = plan.train_config(self.cfg, self.run_dir, 0)
        spec = objective_for(plan.round_store_kind(self.cfg), unpaired=False, group_by_prompt=round_cfg.data.group_by_prompt,
                             objective=self.cfg.train.objective)
        return spec.options(settings)

    @property
    def eval_tasks(self) -> dict:
        return self.eval_feed.eval_tasks if self.eval_feed is not None else {}

    def begin(self, start: int, metrics) -> None:
        self.metrics, self.start = metrics, start
        if start and start % self.per_round == 0:  # resumed at a round's end: its record first, if a kill skipped it
            self._record(start // self.per_round - 1, self._logged_eval(start))
        if start < self.num_steps:
            self._enter(start // self.per_round, start)
        if self.eval_feed is None and self.cfg.data.eval:  # resumed into a round that trains nothing
            self.eval_feed = self._last_store_feed(start // self.per_round)

    def step(self, k: int) -> FeedStep | None:
        r = k // self.per_round
        if r != self.round:
            self._enter(r, k)
        if self.feed is None:  # every prompt's samples tied: the round trains nothing
            return None
        local = k - r * self.per_round
        work = self.feed.step(local)
        fresh = local == 0 and r > 0 and self.cfg.rounds.optimizer == "reset"
        return FeedStep(work.objective, work.ids, work.key, work.epoch, {"round": r}, reset_optimizer=fresh)

    def boundary(self, done: int) -> bool:
        return self.each_round and done % self.per_round == 0

    def step_done(self, done: int, evaluation: dict | None) -> None:
        if done % self.per_round == 0:
            self._record(done // self.per_round - 1, evaluation)
        if done == self.num_steps and not self.each_round:  # the run's model, where the rounds' summary names it
            final = Path(plan.policy_of(self.cfg, self.run_dir, self.cfg.rounds.count))
            if not (final / "config.json").is_file() and final != Path(plan.initial_policy(self.cfg)):
                self._export(final.parent)

    def close(self) -> None:
        """The sampling running meanwhile stopped, a vLLM server the run started stopped (``RoundSampler.close``)."""
        self.sampler.close()

    def state_dict(self) -> dict[str, Any]:
        return self.feed.state_dict() if self.feed is not None else dict(self._state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._state = dict(state)  # the objective's, given to the round's objective once it is built

    # ------------------------------------------------------------------------------------------ a round

    def _enter(self, r: int, k: int) -> None:
        """Round ``r`` from step ``k``: its samples, scores and store made where missing (only at its first step: the
        policy is then the round's), its reference moved to the policy (``round_start``), its objective built."""
        from prefpack.rounds.phases import (
            RoundsError,
            SharedScores,
            _eval_prompts,
            _generate,
            _score,
            scores_over_ranks,
        )
        from prefpack.rounds.reference import precompute_from_policy, precompute_round_reference

        cfg, run_dir, ranks = self.cfg, self.run_dir, self.ranks
        folder = plan.round_dir(run_dir, r)
        store, tied = folder / "store", folder / plan.NO_PAIRS_FILE
        at_start = k == r * self.per_round
        made = (store / "meta.json").is_file() or tied.is_file()
        if not made and not at_start:
            raise RoundsError(f"{folder}: the run resumes at step {k}, inside round {r + 1}, but the round's store is "
                              "missing; it was made by another run or deleted. Start the run again (another "
                              "run.output_dir)")
        self.round, self.feed, self.eval_scores = r, None, None
        if at_start and self.moves_reference and r > 0:
            self._reference_to_policy()
        stop = self.stop_at[1:] if self.stop_at is not None and self.stop_at[0] == r else None
        if ranks.is_main:
            folder.mkdir(parents=True, exist_ok=True)
        ranks.together(f"opening round {r + 1}'s folder", lambda: None)
        self.log(f"round {r + 1}/{cfg.rounds.count} from step {k} (the policy in memory)")
        samples = folder / "samples.jsonl"
        if self.overlap:
            ranks.main_only(f"waiting for round {r + 1}'s samples", lambda: self.sampler.join_ahead(r))
        # with overlap a round samples the policy the round before started from (a staleness of one round)
        weights = r - 1 if self.overlap and r > 0 else r
        self.sampler.prepare(r, weights)
        _generate(cfg, run_dir, r, cfg.rounds.prompts, samples, "generate", stop, self.log, ranks,
                  self.sampler.factory(r, weights))
        if not made:
            scorer = self._scorer()  # every rank's under torchrun (each scores its share)
            if ranks.world > 1:  # every rank scores its share; rank 0 writes the store from the whole table
                scorer = SharedScores(scorer, scores_over_ranks(cfg, samples, scorer, ranks))
            ranks.main_only(f"scoring round {r + 1}'s samples",
                            lambda: _score(cfg, r, samples, store, stop, self.log, scorer))
        trains = not tied.is_file()
        if trains and cfg.reference.mode == "precomputed" and cfg.rounds.reference == "round_start":
            # the policy in memory is the round's reference: each rank scores its share with its full copy (FSDP2:
            # the shards gathered), rank 0 writes the sidecar, every rank takes the tag it was recorded with
            model = self.sampler.whole_policy()
            self.engine.reference.reference_hash = precompute_from_policy(cfg, run_dir, r, model, self.engine.parallel,
                                                                          self.log)
            del model
        elif trains and cfg.reference.mode == "precomputed":
            ranks.main_only(f"computing round {r + 1}'s reference log-probs",
                            lambda: precompute_round_reference(cfg, run_dir, r, self.log))
        if cfg.rounds.eval_prompts:
            self.eval_scores = _eval_prompts(cfg, run_dir, r, stop, self.log, ranks, self.sampler.factory(r, r),
                                             self._scorer() if ranks.is_main else None)
        if self.overlap and at_start and ranks.is_main:
            self.sampler.start_ahead(r + 1)
        if not trains:
            if not self._recorded(r):
                ranks.main_only(f"recording round {r + 1}", lambda: self._write_round(r, read_json(tied), None))
                mean = read_json(folder / ROUND_FILE).get("reward/mean", float("nan")) if ranks.is_main else 0.0
                self.log(f"round {r + 1}: every prompt's samples tie (reward mean {mean:.3f}): nothing to train on; "
                         "the policy carries over")
            return
        self.feed = self._store_feed(r)
        self.eval_feed = self.feed
        if self._state:
            self.feed.load_state_dict(self._state)
            self._state = {}
        self.started = time.perf_counter()

    def _store_feed(self, r: int):
        """Round ``r``'s StoreFeed: its pair store (checked against the run's tokenizer and the model's vocabulary)
        and data.eval, for the engine's weights."""
        from prefpack.data.store import StoreError
        from prefpack.model import check_vocab_fits
        from prefpack.tokenizer import tokenizer_matches

        round_cfg = plan.train_config(self.cfg, self.run_dir, r)
        stores = open_stores(round_cfg, unpaired=False)
        store = stores.train[0][1]
        if not self.cfg.model.allow_tokenizer_mismatch and not tokenizer_matches(self.tokenizer.load(),
                                                                                 store.meta["tokenizer"]):
            raise StoreError(f"{store.path}: the round's samples were tokenised with another tokenizer than the "
                             "policy's (rounds.tokenizer)")
        check_vocab_fits(self.engine.policy, store.meta, str(store.path))
        return store_feed(round_cfg, stores, self.engine, pad_id=self.pad_id, log=self.log)

    def _last_store_feed(self, r: int):
        """data.eval's objectives when the current round trains nothing: the last trained round's."""
        k = plan.last_trained(self.run_dir, r)
        return self._store_feed(k) if k is not None else None

    def _scorer(self):
        """The scorer ``rounds.reward_fn`` / ``rounds.reward_model`` names, made at its first use and kept."""
        if self.scorer is None:
            from prefpack.rewards.run import make_scorer

            self.scorer = make_scorer(plan.score_options(self.cfg, Path(), Path(), pairs=True))
        return self.scorer

    @torch.no_grad()
    def _reference_to_policy(self) -> None:
        """``rounds.reference: round_start`` with a copied reference: the reference takes the policy's weights (LoRA:
        merged into a copy), as the round driver loads it from the last round's final model."""
        from prefpack.reference import sync_reference
        from prefpack.training.checkpoint.final import merged_dequantized

        engine = self.engine
        policy, reference = engine.policy, engine.reference.model
        if not hasattr(policy, "merge_and_unload"):  # ref <- 0 * ref + policy: exact (FSDP2: shard by shard)
            fsdp = self.cfg.distributed.strategy == "fsdp2" and engine.parallel.dist.enabled
            sync_reference(policy, reference, 1.0, wrappers=(engine.module, engine.reference.module) if fsdp else ())
            return
        weights = dict(merged_dequantized(policy).named_parameters())  # LoRA (not under FSDP2: plan.why_restart)
        for name, ref in reference.named_parameters():
            ref.copy_(weights[name].to(ref.dtype))
        for module in reference.modules():  # its vision weights' key is computed again (as sync_reference does)
            module.__dict__.pop("_prefpack_vision_key", None)

    # ------------------------------------------------------------------------------------------ the record

    def _logged_eval(self, step: int) -> dict | None:
        """The evaluation logged at ``step`` (the run's metrics file), for a record a kill skipped."""
        from prefpack.metrics import METRICS_FILE, read_metrics

        path = self.run_dir / METRICS_FILE
        lines = read_metrics(path) if path.is_file() else []
        found = [x for x in lines if x.get("split") == "eval" and int(x.get("step", -1)) == step]
        if not found:
            return None
        return {k: v for k, v in found[-1].items() if k not in ("step", "split", "time", "round")}

    def _recorded(self, r: int) -> bool:
        """Whether round ``r``'s record stands: its ``round.json`` written, and its metrics line (logged at the
        round's first step) not dropped by this process's resume."""
        return (plan.round_dir(self.run_dir, r) / ROUND_FILE).is_file() and r * self.per_round <= self.start

    def _export(self, where: Path) -> None:
        """The policy as a final model in ``where/final``, every rank taking part (FSDP2 gathers)."""
        export_policy(self.cfg, self.engine, self.tokenizer, where, self.engine.parallel.dist)

    def _record(self, r: int, evaluation: dict | None) -> None:
        """Round ``r``'s end: its model exported (every round's with ``rounds.save_each_round``, else the last's), its
        phases and metrics line written, ``round.json`` last (the round is done); nothing for a round recorded
        before or one that trained nothing."""
        from prefpack.data.store import Store

        folder = plan.round_dir(self.run_dir, r)
        if r < 0 or self._recorded(r) or not (folder / "store" / "meta.json").is_file():
            return
        if self.each_round or r == self.cfg.rounds.count - 1:
            self._export(folder / "train")
        seconds = time.perf_counter() - self.started if self.started is not None and self.round == r else None
        scores = self.eval_scores if self.round == r else self._read_eval_scores(folder)

        def write() -> None:
            if seconds is not None:
                record_phase(folder, "train", seconds=seconds)
            self._write_round(r, Store(folder / "store").meta, evaluation, scores)

        self.ranks.main_only(f"recording round {r + 1}", write)

    def _write_round(self, r: int, scored: dict, evaluation: dict | None, scores: list[float] | None = None) -> None:
        from prefpack.rounds.phases import _record

        folder = plan.round_dir(self.run_dir, r)
        if scores is None and self.round == r:
            scores = self.eval_scores
        _record(self.metrics, r, r * self.per_round, folder / "samples.jsonl", scored, evaluation, scores)
        line = read_json(folder / ROUND_FILE)
        if line.get("pairs"):
            self.log(f"round {r + 1}: sample reward mean {line['reward/mean']:.4f} (min {line['reward/min']:.3f}, "
                     f"max {line['reward/max']:.3f}), {line['pairs']} pairs, {line['tied_prompts']} tied prompts "
                     "skipped")

    def _read_eval_scores(self, folder: Path) -> list[float] | None:
        import json

        path = folder / "eval_scores.jsonl"
        if not path.is_file() or not self.ranks.is_main:
            return None
        with open(path, encoding="utf-8") as fh:
            return [s for line in fh if line.strip() for s in json.loads(line)["scores"]]
