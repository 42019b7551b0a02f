"""What samples a round in one process: the policy in memory (the transformers engine), or the run's vLLM server(s),
started once or reached by URL and given each round's policy in place, under a version they must confirm before they
sample (never stale weights silently). With ``rounds.overlap`` the next round is sampled in a thread while this one
trains. Rank 0 drives the servers; every rank samples its share in memory.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from prefpack.distributed import SINGLE, Dist
from prefpack.rounds import plan
from prefpack.rounds.metrics import read_json, record_phase

__all__ = ["RoundSampler", "export_policy", "weights_version"]


def weights_version(run_dir: Path, r: int) -> str:
    """The name round ``r``'s weights are served under: the run (its folder's absolute path, hashed) and the round,
    so a server another run updated is never taken for this one's."""
    import hashlib

    run = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:10]
    return f"{run}-round-{r + 1:03d}"


def export_policy(cfg, engine, tokenizer, where: Path, ctx: Dist) -> None:
    """The policy saved as a final model in ``where/final`` (LoRA merged into a copy; the policy trains on)."""
    from prefpack.engine import final_dtype
    from prefpack.training.checkpoint import save_final
    from prefpack.training.guards import check_finite_weights

    params = [p for p in engine.policy.parameters() if p.requires_grad]
    check_finite_weights(params, ctx)  # never a NaN model saved
    if ctx.is_main:
        where.mkdir(parents=True, exist_ok=True)
    save_final(where, engine.policy, tokenizer, module=engine.module, ctx=ctx, strategy=cfg.distributed.strategy,
               dtype=final_dtype(cfg, engine.precision), keep_policy=True)


class RoundSampler:
    """The sampling engines of a run's rounds (see the module doc). ``engine``: the run's weights (prefpack's
    ``Engine``); ``tokenizer``: what an exported model is saved with."""

    def __init__(self, cfg, run_dir: Path, engine, *, pad_id: int, tokenizer, log):
        self.cfg, self.run_dir, self.engine = cfg, Path(run_dir), engine
        self.dist = engine.parallel.dist
        self.per_rank = plan.servers_per_rank(cfg, self.dist.world)  # each rank drives servers of its own
        self.pad_id, self.tokenizer, self.log = pad_id, tokenizer, log
        rc = cfg.rounds
        self.per_round, self.each_round, self.overlap = rc.steps_per_round, rc.save_each_round, rc.overlap
        self.live = None  # rounds.engine vllm: the run's server(s), kept across rounds (rank 0)
        self.pushed: str | None = None  # the weights version the live server was last given
        self.ahead = None  # (round, thread, its outcome, its stop) of the sampling running meanwhile (rank 0)

    def factory(self, r: int, weights_of: int):
        """What ``phases._generate`` builds round ``r``'s engine with: the weights round ``weights_of`` started
        from (``r``; with overlap, the round before), which are the policy in memory when ``weights_of == r``."""
        return lambda source: self.engine_for(source, r, weights_of, now=r)

    def engine_for(self, source, r: int, weights_of: int, *, now: int):
        """Round ``r``'s engine, sampling round ``weights_of``'s starting policy; ``now``: the round whose start
        the policy in memory stands at."""
        if self.cfg.rounds.engine == "vllm":  # the ranks' chunks are rounds.batch_size prompts, as in memory
            return _Kept(self._live(source, r, weights_of, now),
                         batch_prompts=self.cfg.rounds.batch_size if self.per_rank else None)
        from prefpack.generation.hf_engine import TransformersEngine

        # recorded as the folder the round's policy is exported to (the same weights): a samples file either loop
        # wrote continues in the other
        opts = plan.generate_options(self.cfg, self.run_dir, r, prompts=self.cfg.rounds.prompts, output=Path())
        where = opts.model if not opts.adapter else f"{opts.model} + adapter {opts.adapter}"
        if not self.each_round:  # no round's model is saved: the policy as it stands at the round's first step
            where = f"the policy in memory at step {r * self.per_round}"
        return TransformersEngine.of_policy(self._sampling_model(), pad_id=self.pad_id,
                                            batch_size=self.cfg.rounds.batch_size, source=where)

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
        if self.cfg.distributed.strategy == "fsdp2" and self.engine.parallel.dist.enabled:
            return self._gathered(saved).to(sampled)
        if all(p.dtype == saved == sampled for p in policy.parameters()):
            return policy
        import copy

        # each parameter made in the sampled dtype before the copy takes it (deepcopy's memo), so the copy never
        # holds a second set of the training weights: the peak is the policy and one copy in the sampled dtype
        memo = {id(p): torch.nn.Parameter(p.detach().to(saved).to(sampled), requires_grad=False)
                for p in policy.parameters()}
        return copy.deepcopy(policy, memo)

    def whole_policy(self):
        """The policy with all its weights on this rank: itself, or under FSDP2 its shards gathered into a copy (in
        the training weights' dtype) that the caller drops after use."""
        if self.cfg.distributed.strategy == "fsdp2" and self.dist.enabled:
            return self._gathered(self.engine.precision.weights)
        return self.engine.policy

    def gathered_state(self) -> dict:
        """FSDP2: the policy's full state dict on every rank (keys as the policy's own), as ``save_final`` gathers it
        for the final folder; every rank takes part."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.engine.module, options=StateDictOptions(full_state_dict=True))
        return {k.removeprefix("model."): v for k, v in full.items()}

    def _gathered(self, dtype: torch.dtype):
        """FSDP2: the policy's shards gathered on every rank (each samples its chunks) into a plain model in
        ``dtype``; LoRA: the base built from its config under the same adapter, unmerged, as the policy trains it."""
        import copy

        from transformers import AutoModelForCausalLM
        from transformers.initialization import no_init_weights

        policy = self.engine.policy
        state = {k: v.to(dtype) for k, v in self.gathered_state().items()}
        lora = hasattr(policy, "peft_config")
        with no_init_weights():  # every weight is loaded below
            model = AutoModelForCausalLM.from_config((policy.get_base_model() if lora else policy).config, dtype=dtype)
        if lora:
            from peft import get_peft_model

            name = policy.active_adapter
            model = get_peft_model(model, copy.deepcopy(policy.peft_config[name]), adapter_name=name)
        model.load_state_dict(state)
        del state
        return model.to(device=self.engine.device, dtype=dtype)

    # ------------------------------------------------------------------------------------------ live servers

    def _live(self, source, r: int, weights_of: int, now: int):
        """The run's vLLM server(s): started once (``rounds.vllm_command``, on the initial model) or reached
        (``rounds.vllm_url``, one or several), then given round ``weights_of``'s starting policy in place: LoRA as an
        adapter loaded at run time, else the full weights reloaded from the folder the policy was exported to."""
        from prefpack.generation.run import build_engine

        cfg = self.cfg
        if self.live is None:
            opts = plan.generate_options(cfg, self.run_dir, 0, prompts=cfg.rounds.prompts,
                                         output=self.run_dir / "sampler.jsonl")  # its log: sampler.vllm.log
            opts.adapter = None  # a LoRA run's server serves the base; each round's adapter is loaded into it
            if self.per_rank:
                from prefpack.generation.run import vllm_urls

                opts.vllm_url = vllm_urls(cfg.rounds.vllm_url)[self.dist.rank::self.dist.world]
            self.live = build_engine(opts, source)
            self.log(f"vLLM sampler for every round: {', '.join(self.live.describe().get('urls') or [self.live.url])}")
        version = weights_version(self.run_dir, weights_of)
        if self.pushed != version:
            t0 = time.perf_counter()
            if not self.each_round:  # no round's model is saved: the policy written for the servers, then given
                folder = self._export_for_sampler(version, in_memory=weights_of == now)
            elif cfg.lora.enabled:
                folder = plan.adapter_of(cfg, self.run_dir, weights_of) or self._start_adapter(weights_of)
            else:
                folder = plan.policy_of(cfg, self.run_dir, weights_of)
            if cfg.lora.enabled:
                self.live.load_adapter(folder, version)
            else:
                self.live.update_weights(folder, version)
            self.pushed = version
            self._drop_sampler_folders(keep=(version, *self._versions_in_use()))
            self.log(f"round {r + 1}: the vLLM sampler serves {version} ({time.perf_counter() - t0:.2f} s)")
        return self.live

    def _export_for_sampler(self, version: str, *, in_memory: bool) -> str:
        """The policy in memory written where the servers read it, ``RUN_DIR/sampler/VERSION`` (LoRA: the adapter
        alone; else the whole model, as a round's final model is written). ``in_memory``: the version is the policy
        as it stands (else an earlier one, which only its kept folder holds)."""
        folder = self.run_dir / "sampler" / version
        if not in_memory and not folder.is_dir():
            from prefpack.rounds.phases import RoundsError

            raise RoundsError(f"a round's samples are drawn from the policy the round before started from, and its "
                              f"copy ({folder}) is gone; resume from an earlier checkpoint (move the later ones "
                              "aside) so the run passes that round's start again")
        if self.cfg.lora.enabled:
            if not (folder / "adapter_config.json").is_file():
                self.engine.policy.save_pretrained(folder)
            return str(folder)
        if not (folder / "final" / "config.json").is_file():
            export_policy(self.cfg, self.engine, self.tokenizer, folder, SINGLE)  # the servers' copy: rank 0's
        return str(folder / "final")

    def prepare(self, r: int, weights_of: int) -> None:
        """Where each rank drives its own servers, what they will read written first by every rank together (rank 0
        writes; FSDP2 gathers): the policy's copy for the servers (``rounds.save_each_round: false``) and round 1's
        fresh adapter, so no two ranks write one folder."""
        if not self.per_rank or weights_of != r or \
                read_json(plan.round_dir(self.run_dir, r) / "samples.meta.json").get("complete"):
            return
        version = weights_version(self.run_dir, weights_of)
        folder = self.run_dir / "sampler" / version
        if not self.each_round and not self.cfg.lora.enabled and not (folder / "final" / "config.json").is_file():
            export_policy(self.cfg, self.engine, self.tokenizer, folder, self.dist)
        elif self.dist.is_main:
            if not self.each_round and self.cfg.lora.enabled:
                self._export_for_sampler(version, in_memory=True)
            elif self.each_round and self.cfg.lora.enabled and not plan.adapter_of(self.cfg, self.run_dir, r):
                self._start_adapter(r)
        self.dist.barrier()

    def _start_adapter(self, r: int) -> str:
        """A fresh adapter (round 1 without ``lora.adapter``) saved for the server to load (rank 0 samples)."""
        folder = plan.round_dir(self.run_dir, r) / "start_adapter"
        if not (folder / "adapter_config.json").is_file():
            self.engine.policy.save_pretrained(folder)
        return str(folder)

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

    def start_ahead(self, r: int) -> None:
        """Round ``r``'s sampling begun in a thread, from the policy as it stands (round ``r - 1``'s start), while
        round ``r - 1`` trains (the thread waits on the servers; the loop's process trains meanwhile)."""
        import threading

        from prefpack.generation.run import prompt_source, sample_prompts, settings_of

        if r >= self.cfg.rounds.count:
            return
        folder = plan.round_dir(self.run_dir, r)
        if read_json(folder / "samples.meta.json").get("complete"):
            return
        folder.mkdir(parents=True, exist_ok=True)
        opts = plan.generate_options(self.cfg, self.run_dir, r, prompts=self.cfg.rounds.prompts,
                                     output=folder / "samples.jsonl")
        source = prompt_source(opts)
        settings = settings_of(opts, source)
        engine = self.engine_for(source, r, r - 1, now=r - 1)  # the server given the policy in memory
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

    def join_ahead(self, r: int) -> None:
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
        folder = plan.round_dir(self.run_dir, r)
        record_phase(folder, "generate", **read_json(folder / "phases.json").get("generate", {}), waited=waited)

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


class _Halt:
    """The stop a thread's sampling reads between chunks (signals reach the main thread only): set by ``close``."""

    signum = 0

    def due(self) -> bool:
        return bool(self.signum)


class _Kept:
    """A sampler that lives across rounds, handed to one round's sampling: ``close`` leaves it running."""

    def __init__(self, engine, *, batch_prompts: int | None = None):
        self.engine = engine
        self.name, self.batch_prompts = engine.name, batch_prompts or engine.batch_prompts
        self.batch_dependent = getattr(engine, "batch_dependent", False)

    def generate(self, jobs, settings):
        return self.engine.generate(jobs, settings)

    def describe(self) -> dict:
        return self.engine.describe()

    def close(self) -> None:
        return None
