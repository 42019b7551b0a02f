"""Where each round's files live and what each phase is asked: the round's policy folder, its generate options and
score options, and the training config derived from the run's (the same keys, with the round's store, steps and
folder). Pure functions of the config and the round, so a resumed run asks every phase exactly what it asked before.

Round ``r`` (from 0) lives in ``RUN_DIR/rounds/NNN/`` (NNN = r + 1): ``samples.jsonl`` (+ ``samples.meta.json``), the
scored pair store ``store/``, the round's training run ``train/`` (its checkpoints, metrics and ``final/`` model),
``phases.json`` (the seconds and tokens of each finished phase) and ``round.json`` (written last: the round is done).
A later round whose samples all tie writes ``no_pairs.json`` (what scoring saw) instead of ``store/`` and ``train/``:
it trains nothing, and the next round samples the last policy that trained.
"""

from __future__ import annotations

import copy
from pathlib import Path

from prefpack.generation.run import GenerateOptions
from prefpack.generation.subsets import PromptSubset
from prefpack.objectives.names import train_objective
from prefpack.rewards.run import ScoreOptions


def round_dir(run_dir: Path, r: int) -> Path:
    return run_dir / "rounds" / f"{r + 1:03d}"


def initial_policy(cfg) -> str:
    return str(cfg.model.name_or_path)


NO_PAIRS_FILE = "no_pairs.json"  # a round after the first whose samples all tie: scored, recorded, not trained


def last_trained(run_dir: Path, r: int) -> int | None:
    """The last round before ``r`` that trained (None: none did), read from the finished rounds' files alone, so a
    resumed run and every rank under torchrun find the same one."""
    return next((k for k in range(r - 1, -1, -1) if not (round_dir(run_dir, k) / NO_PAIRS_FILE).is_file()), None)


def policy_of(cfg, run_dir: Path, r: int) -> str:
    """The policy round ``r`` samples and starts training from: the initial model, then the final of the last round
    that trained (a round whose samples all tied carries its policy over)."""
    k = last_trained(run_dir, r)
    return initial_policy(cfg) if k is None else str(round_dir(run_dir, k) / "train" / "final")


def adapter_of(cfg, run_dir: Path, r: int) -> str | None:
    """LoRA: the adapter round ``r`` samples with and trains on over the unchanged base (``lora.adapter`` or a fresh
    one first, then the last trained round's ``final/adapter``); None without LoRA."""
    if not cfg.lora.enabled:
        return None
    k = last_trained(run_dir, r)
    return cfg.lora.adapter if k is None else str(round_dir(run_dir, k) / "train" / "final" / "adapter")


def reference_of(cfg, run_dir: Path, r: int) -> str:
    """The weights of round ``r``'s copied or precomputed reference: the initial policy (``reference.model`` when
    set) or the round's starting policy (LoRA: the last round's merged ``final/``)."""
    if cfg.rounds.reference == "initial":
        return cfg.reference.model or initial_policy(cfg)
    return policy_of(cfg, run_dir, r)


def prompt_inputs(value) -> tuple[str | None, list[str]]:
    """(store folder, JSONL inputs) of ``rounds.prompts`` / ``rounds.eval_prompts``."""
    items = [value] if isinstance(value, str) else list(value or [])
    if len(items) == 1 and Path(items[0]).is_dir():
        return items[0], []
    return None, items


def generate_options(cfg, run_dir: Path, r: int, *, prompts, output: Path, held_out: bool = False) -> GenerateOptions:
    """Round ``r``'s sampling of ``prompts``: ``rounds.prompts_per_round`` of them (seeded by ``rounds.seed``), or
    every one (``held_out``: ``rounds.eval_prompts``, always whole)."""
    rc = cfg.rounds
    store, inputs = prompt_inputs(prompts)
    base_and_adapter = cfg.lora.enabled and rc.engine == "transformers"  # vLLM serves the merged final/
    # no round's model saved (online training): the initial folder names the model's end-of-turn ids, as each would
    policy = policy_of(cfg, run_dir, r) if rc.save_each_round else initial_policy(cfg)
    return GenerateOptions(
        output=str(output), model=initial_policy(cfg) if base_and_adapter else policy,
        adapter=adapter_of(cfg, run_dir, r) if base_and_adapter else None, store=store, inputs=inputs,
        subset=PromptSubset(rc.prompts_per_round, rc.seed, r) if rc.prompts_per_round and not held_out else None,
        quantization=cfg.model.quantization if base_and_adapter else None,
        quantization_double=cfg.model.quantization_double,
        tokenizer=rc.tokenizer or cfg.model.tokenizer or initial_policy(cfg), prompt_field=rc.prompt_field,
        engine=rc.engine, n=rc.samples_per_prompt, temperature=rc.temperature, top_p=rc.top_p,
        max_new_tokens=rc.max_new_tokens, seed=rc.seed + r, batch_size=rc.batch_size, device=cfg.train.device,
        vllm_url=rc.vllm_url, vllm_command=rc.vllm_command, trust_remote_code=cfg.model.trust_remote_code)


def check_prompt_subset(cfg) -> None:
    """A ``rounds.prompts_per_round`` larger than the prompt set, refused before the run folder is written (one
    line naming both numbers)."""
    if cfg.rounds.prompts_per_round:
        from prefpack.generation.run import prompt_source

        prompt_source(generate_options(cfg, Path(cfg.run.output_dir), 0, prompts=cfg.rounds.prompts, output=Path()))


def round_store_kind(cfg) -> str:
    """What a round's store holds: ``ranked`` (every sample of a prompt with its score: group policy gradients) or
    ``pairs`` (the pairs ``rounds.pairs`` draws), as the objective's row says (``round_output``)."""
    return train_objective(cfg).round_output


def score_options(cfg, samples: Path, output: Path, *, pairs: bool) -> ScoreOptions:
    """How a round scores: ``pairs`` a store (the pairs ``rounds.pairs`` draws, or every sample ranked where the
    objective trains on all of them: ``round_output`` of its row in ``objectives/names.py``), else a JSONL file."""
    rc = cfg.rounds
    ranked = round_store_kind(cfg) == "ranked"
    return ScoreOptions(input=str(samples), output=str(output), reward_model=rc.reward_model, reward_fn=rc.reward_fn,
                        reward_timeout=rc.reward_timeout,
                        format="store" if pairs else "jsonl", pairs=rc.pairs if pairs and not ranked else None,
                        min_gap=rc.min_gap, device=cfg.train.device, trust_remote_code=cfg.model.trust_remote_code,
                        allow_tokenizer_mismatch=cfg.model.allow_tokenizer_mismatch, progress=False)


def train_config(cfg, run_dir: Path, r: int):
    """The run's config for round ``r``'s training: its pair store, ``steps_per_round`` steps, its own folder, the
    round's starting policy (LoRA: the base, never rewritten, and the last round's adapter); a copied or precomputed
    reference is the initial policy (``rounds.reference: initial``) or the round's starting policy."""
    rc = cfg.rounds
    out = copy.deepcopy(cfg)
    out.rounds.count = 0
    if cfg.lora.enabled:
        out.lora.adapter = adapter_of(cfg, run_dir, r)
    else:
        out.model.name_or_path = policy_of(cfg, run_dir, r)
    out.data.train = str(round_dir(run_dir, r) / "store")
    # several pairs of one prompt: the prompt laid out once (a ranked round store is read by prompt anyway)
    out.data.group_by_prompt = rc.pairs != "best_vs_worst" and round_store_kind(cfg) == "pairs"
    out.train.max_steps = rc.steps_per_round
    out.train.seed = cfg.train.seed + r
    out.run.output_dir = str(round_dir(run_dir, r) / "train")
    out.run.plot = False  # the whole run's curves are drawn once, from RUN_DIR/metrics.jsonl
    if cfg.reference.mode in ("copy", "precomputed"):
        out.reference.model = reference_of(cfg, run_dir, r)
    return out


def why_restart(cfg) -> str | None:
    """Why the rounds cannot run in one training process (each round is then a whole training run, the policy read
    back from its saved folder), in words; None: they run in one process (``prefpack.rounds.live``)."""
    import os

    rc = cfg.rounds
    if not rc.in_process:
        return "rounds.in_process=false"
    if started_per_round(Path(cfg.run.output_dir)):
        return ("the run folder was started with each round a training run (prefpack before rounds ran in one "
                "process), and it resumes so")
    if cfg.distributed.strategy == "fsdp2" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if cfg.model.quantization:
            return "a 4-bit base under FSDP2 cannot be gathered into a copy to sample"
        if cfg.lora.enabled and cfg.reference.mode == "copy" and rc.reference == "round_start":
            return "a copied round_start reference of LoRA under FSDP2 takes the merged policy, which is not gathered yet"
    return None


def servers_per_rank(cfg, world: int) -> bool:
    """Rounds in one process under torchrun with ``rounds.vllm_url`` naming at least a server a rank: each rank drives
    its own (rank k the URLs k, k + world, ...) and samples its chunks of ``rounds.batch_size`` prompts, as the ranks
    share the in-process engine's chunks; else rank 0 drives every server (and ``rounds.overlap`` keeps it so)."""
    rc = cfg.rounds
    if world < 2 or rc.engine != "vllm" or not rc.vllm_url or rc.overlap or why_restart(cfg) is not None:
        return False
    from prefpack.generation.run import vllm_urls

    return len(vllm_urls(rc.vllm_url)) >= world


def started_per_round(run_dir: Path) -> bool:
    """Whether a run folder holds rounds run as separate trainings (each round's own checkpoints or metrics, and no
    checkpoint of the run's own): a folder an older prefpack began, which a resume continues the same way."""
    if (run_dir / "checkpoints").is_dir():
        return False
    rounds = run_dir / "rounds"
    return rounds.is_dir() and any((d / "train" / "metrics.jsonl").is_file() or (d / "train" / "checkpoints").is_dir()
                                   for d in rounds.iterdir())
