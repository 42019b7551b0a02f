"""The rounds as a :class:`~prefpack.training.feed.Feed`: the training loop runs every round's steps in one process,
with one engine (the policy loaded once), one optimizer and one learning-rate schedule, and this feed makes each
round's examples at the round's first step.

At round ``r``'s first step the policy the loop holds is the round's policy: it samples the round's prompts in
memory (``TransformersEngine.of_policy``; nothing is read back from disk), the samples are scored and the round's
pair store written (the same files as the round driver's, which stay the resume record: ``plan``'s layout), and the
round's objective is built over that store for the weights as the engine holds them. At the round's last step the
loop evaluates and checkpoints (``boundary``), then the feed records the round (``after_boundary``): the round's model
exported to ``rounds/NNN/train/final``, its phases' seconds, its metrics line and ``round.json``. A resume from a
round's closing checkpoint whose record is missing records it first (``begin``), reading that step's evaluation back
from the run's metrics.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from prefpack.distributed import SINGLE
from prefpack.rounds import plan
from prefpack.rounds.metrics import ROUND_FILE, read_json, record_phase
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
        self.live = None  # rounds.engine vllm: the run's server(s), kept across rounds (rank 0)
        self.pushed: str | None = None  # the weights version the live server was last given
        self.overlap = rc.overlap  # round r + 1 sampled (from round r's starting policy) while round r trains
        self.ahead = None  # (round, thread, its outcome) of the sampling running meanwhile (rank 0)
        self.sampling_round = 0  # the round whose policy the live server is to serve for the sampling asked now
        self._state: dict[str, Any] = {}

    # ------------------------------------------------------------------------------------------ what the loop reads

    def forward_options(self) -> dict:
        """The pair objectives' options from the settings alone: the forward is wrapped before round 1's store exists."""
        from prefpack.objectives import settings_from_config
        from prefpack.objectives.pairs import pair_forward_options
        from prefpack.training.feed import moe_coefficient

        b = self.engine.budgets
        coef = moe_coefficient(self.cfg, self.engine.policy, kto=False, log=lambda *_: None)
        settings = settings_from_config(self.cfg, pad_id=self.pad_id, micro_batch_tokens=b.micro_batch_tokens,
                                        row_tokens=b.row_tokens, chunk_size=b.chunk_size, shares_prompts=False,
                                        router_aux_loss_coef=coef)
        return pair_forward_options(settings)

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
        from prefpack.rounds.reference import precompute_round_reference

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
        self.log(f"round {r + 1}/{cfg.rounds.count}: policy in memory (step {k})")
        samples = folder / "samples.jsonl"
        if self.overlap:
            ranks.main_only(f"waiting for round {r + 1}'s samples", lambda: self._join_ahead(r))
        # with overlap a round samples the policy the round before started from (a staleness of one round)
        self.sampling_round = r - 1 if self.overlap and r > 0 else r
        _generate(cfg, run_dir, r, cfg.rounds.prompts, samples, "generate", stop, self.log, ranks, self._sampler)
        self.sampling_round = r
        if not made:
            scorer = self._scorer() if ranks.is_main or ranks.world > 1 else None
            if ranks.world > 1:  # every rank scores its share; rank 0 writes the store from the whole table
                scorer = SharedScores(scorer, scores_over_ranks(cfg, samples, scorer, ranks))
            ranks.main_only(f"scoring round {r + 1}'s samples",
                            lambda: _score(cfg, r, samples, store, stop, self.log, scorer))
        trains = not tied.is_file()
        if trains and cfg.reference.mode == "precomputed":
            ranks.main_only(f"computing round {r + 1}'s reference log-probs",
                            lambda: precompute_round_reference(cfg, run_dir, r, self.log))
        if cfg.rounds.eval_prompts:
            self.eval_scores = _eval_prompts(cfg, run_dir, r, stop, self.log, ranks, self._sampler,
                                             self._scorer() if ranks.is_main else None)
        if self.overlap and at_start and ranks.is_main:
            self._start_ahead(r + 1)
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

    def _sampler(self, source):
        """The policy in memory as the sampling engine, its weights as the round's saved final model holds them; with
        ``rounds.engine: vllm`` the run's live server(s), given the round's weights first (:meth:`_live`)."""
        if self.cfg.rounds.engine == "vllm":
            return _Kept(self._live(source))
        from prefpack.generation.hf_engine import TransformersEngine

        # recorded as the folder the round's policy is exported to (the same weights): a samples file either loop
        # wrote continues in the other
        opts = plan.generate_options(self.cfg, self.run_dir, self.round, prompts=self.cfg.rounds.prompts, output=Path())
        where = opts.model if not opts.adapter else f"{opts.model} + adapter {opts.adapter}"
        if not self.each_round:  # no round's model is saved: the policy as it stands at the round's first step
            where = f"the policy in memory at step {self.round * self.per_round}"
        return TransformersEngine.of_policy(self._sampling_model(), pad_id=self.pad_id,
                                            batch_size=self.cfg.rounds.batch_size, source=where)

    def _live(self, source):
        """The run's vLLM server(s): started once (``rounds.vllm_command``, on the initial model) or reached
        (``rounds.vllm_url``, one or several), then given round ``self.round``'s policy in place: LoRA as an adapter
        loaded at run time, else the full weights reloaded from the folder the policy was exported to, each under a
        version the server must confirm before it samples (never stale weights silently)."""
        from prefpack.generation.run import build_engine

        cfg, r = self.cfg, self.sampling_round
        if self.live is None:
            opts = plan.generate_options(cfg, self.run_dir, 0, prompts=cfg.rounds.prompts,
                                         output=self.run_dir / "sampler.jsonl")  # its log: sampler.vllm.log
            opts.adapter = None  # a LoRA run's server serves the base; each round's adapter is loaded into it
            self.live = build_engine(opts, source)
            self.log(f"vLLM sampler for every round: {', '.join(self.live.describe().get('urls') or [self.live.url])}")
        version = weights_version(self.run_dir, r)
        if self.pushed != version:
            t0 = time.perf_counter()
            if not self.each_round:  # no round's model is saved: the policy written for the servers, then given
                folder = self._export_for_sampler(version)
            elif cfg.lora.enabled:
                folder = plan.adapter_of(cfg, self.run_dir, r) or self._start_adapter(r)
            else:
                folder = plan.policy_of(cfg, self.run_dir, r)
            if cfg.lora.enabled:
                self.live.load_adapter(folder, version)
            else:
                self.live.update_weights(folder, version)
            self.pushed = version
            self._drop_sampler_folders(keep=(version, *self._versions_in_use()))
            self.log(f"round {r + 1}: the vLLM sampler serves {version} ({time.perf_counter() - t0:.2f} s)")
        return self.live

    def _export_for_sampler(self, version: str) -> str:
        """The policy in memory written where the servers read it, ``RUN_DIR/sampler/VERSION`` (LoRA: the adapter
        alone; else the whole model, as a round's final model is written)."""
        folder = self.run_dir / "sampler" / version
        if self.sampling_round != self.round and not folder.is_dir():
            from prefpack.rounds.phases import RoundsError

            raise RoundsError(f"round {self.round + 1}'s samples are drawn from the policy round "
                              f"{self.round} started from, and its copy ({folder}) is gone; resume from an earlier "
                              "checkpoint (move the later ones aside) so the run passes that round's start again")
        if self.cfg.lora.enabled:
            if not (folder / "adapter_config.json").is_file():
                self.engine.policy.save_pretrained(folder)
            return str(folder)
        if not (folder / "final" / "config.json").is_file():
            folder.mkdir(parents=True, exist_ok=True)
            self._export(folder, ranks_take_part=False)
        return str(folder / "final")

    def _drop_sampler_folders(self, keep: tuple[str, ...]) -> None:
        """The folders of weights the servers no longer serve (prefpack wrote them, for them alone)."""
        import shutil

        root = self.run_dir / "sampler"
        if root.is_dir():
            for old in root.iterdir():
                if old.is_dir() and old.name not in keep:
                    shutil.rmtree(old, ignore_errors=True)

    def _versions_in_use(self) -> list[str]:
        """With overlap, the version a round's unfinished samples were begun with (a resume continues them with it)."""
        if not self.overlap:
            return []
        out = []
        for r in range(self.cfg.rounds.count):
            meta = read_json(plan.round_dir(self.run_dir, r) / "samples.meta.json")
            if meta and not meta.get("complete"):
                out.append(meta.get("generation", {}).get("weights_version"))
        return [v for v in out if v]

    # ------------------------------------------------------------------------------------------ overlap

    def _start_ahead(self, r: int) -> None:
        """Round ``r``'s sampling begun in a thread, from the policy as it stands (round ``r - 1``'s start), while
        round ``r - 1`` trains (the thread waits on the servers; the loop's process trains meanwhile)."""
        import threading

        if r >= self.cfg.rounds.count:
            return
        folder = plan.round_dir(self.run_dir, r)
        if read_json(folder / "samples.meta.json").get("complete"):
            return
        folder.mkdir(parents=True, exist_ok=True)
        self.sampling_round = r - 1
        opts = plan.generate_options(self.cfg, self.run_dir, r, prompts=self.cfg.rounds.prompts,
                                     output=folder / "samples.jsonl")
        from prefpack.generation.run import prompt_source, sample_prompts, settings_of

        source = prompt_source(opts)
        settings = settings_of(opts, source)
        engine = self._sampler(source)  # the server given round r - 1's starting policy (the one in memory)
        outcome: dict = {}
        halt = _Halt()

        def sample() -> None:
            t0 = time.perf_counter()
            try:
                report = sample_prompts(source, engine, settings, folder / "samples.jsonl", log=self.log, stop=halt)
                record_phase(folder, "generate", seconds=time.perf_counter() - t0, tokens=report.tokens)
            except BaseException as exc:  # raised again where the round waits for it
                outcome["error"] = exc

        thread = threading.Thread(target=sample, name=f"prefpack-round-{r + 1}-sampling", daemon=True)
        thread.start()
        self.ahead = (r, thread, outcome, halt)

    def _join_ahead(self, r: int) -> None:
        """Wait for round ``r``'s sampling begun during the last round (its error, if any, raised here)."""
        if self.ahead is None or self.ahead[0] != r:
            return
        _, thread, outcome, _ = self.ahead
        t0 = time.perf_counter()
        thread.join()
        self.ahead = None
        waited = time.perf_counter() - t0
        if "error" in outcome:
            raise outcome["error"]
        phases = read_json(plan.round_dir(self.run_dir, r) / "phases.json")
        record_phase(plan.round_dir(self.run_dir, r), "generate", **phases.get("generate", {}), waited=waited)
    def _start_adapter(self, r: int) -> str:
        """A fresh adapter (round 1 without ``lora.adapter``) saved for the server to load (rank 0 samples)."""
        folder = plan.round_dir(self.run_dir, r) / "start_adapter"
        if not (folder / "adapter_config.json").is_file():
            self.engine.policy.save_pretrained(folder)
        return str(folder)

    def close(self) -> None:
        """Stop the sampling running meanwhile (at a whole chunk: a resume continues it) and a server the run
        started (a server given by URL keeps running)."""
        if self.ahead is not None:
            _, thread, _, halt = self.ahead
            halt.signum = 15
            thread.join()
            self.ahead = None
        if self.live is not None:
            self.live.close()
            self.live = None

    def _sampling_model(self):
        """The policy, or a copy rounded to the dtype the round's final model is saved in and cast to the dtype the
        transformers engine samples a saved folder in (float32 on CPU, bfloat16 on CUDA): the same weights."""
        from prefpack.engine import final_dtype
        from prefpack.training.checkpoint.final import is_four_bit

        policy = self.engine.policy
        if is_four_bit(policy):
            return policy
        saved = final_dtype(self.cfg, self.engine.precision)
        sampled = torch.bfloat16 if self.engine.device.type == "cuda" else torch.float32
        if all(p.dtype == saved == sampled for p in policy.parameters()):
            return policy
        import copy

        return copy.deepcopy(policy).to(saved).to(sampled)

    @torch.no_grad()
    def _reference_to_policy(self) -> None:
        """``rounds.reference: round_start`` with a copied reference: the reference takes the policy's weights (LoRA:
        merged into a copy), as the round driver loads it from the last round's final model."""
        from prefpack.training.checkpoint.final import merged_dequantized

        policy, reference = self.engine.policy, self.engine.reference.model
        source = merged_dequantized(policy) if hasattr(policy, "merge_and_unload") else policy
        weights = dict(source.named_parameters())
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

    def _export(self, where: Path, ranks_take_part: bool = True) -> None:
        """The policy saved as a final model in ``where/final`` (LoRA merged into a copy; the policy trains on)."""
        from prefpack.engine import final_dtype
        from prefpack.training.checkpoint import save_final
        from prefpack.training.guards import check_finite_weights

        engine, cfg = self.engine, self.cfg
        ctx = engine.parallel.dist if ranks_take_part else SINGLE  # the servers' copy: rank 0's
        params = [p for p in engine.policy.parameters() if p.requires_grad]
        check_finite_weights(params, ctx)  # never a NaN model saved
        if ctx.is_main:
            where.mkdir(parents=True, exist_ok=True)
        save_final(where, engine.policy, self.tokenizer, module=engine.module, ctx=ctx,
                   strategy=cfg.distributed.strategy, dtype=final_dtype(cfg, engine.precision), keep_policy=True)

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


def weights_version(run_dir: Path, r: int) -> str:
    """The name round ``r``'s weights are served under: the run (its folder's absolute path, hashed) and the round,
    so a server another run updated is never taken for this one's."""
    import hashlib

    run = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:10]
    return f"{run}-round-{r + 1:03d}"


class _Halt:
    """The stop a thread's sampling reads between chunks (signals reach the main thread only): set by ``close``."""

    signum = 0

    def due(self) -> bool:
        return bool(self.signum)


class _Kept:
    """A sampler that lives across rounds, handed to one round's sampling: ``close`` leaves it running."""

    def __init__(self, engine):
        self.engine = engine
        self.name, self.batch_prompts = engine.name, engine.batch_prompts
        self.batch_dependent = getattr(engine, "batch_dependent", False)

    def generate(self, jobs, settings):
        return self.engine.generate(jobs, settings)

    def describe(self) -> dict:
        return self.engine.describe()

    def close(self) -> None:
        return None
