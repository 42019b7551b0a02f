"""The config tree itself: typed sections with their choices, defaults and one-line help.

Apart from the value rules (``rules``) and from reading and writing YAML (``io``), so that a new field is
one line here; ``io`` reads the annotations, ``save_config`` writes the help as comments.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, make_dataclass
from typing import Any, Literal

from prefpack.config import rules
from prefpack.errors import PrefpackError
from prefpack.loss_params import LOSS_PARAMS
from prefpack.model.attention.names import ATTENTION_CHOICES
from prefpack.objectives.names import OBJECTIVE_NAMES, train_objective
from prefpack.reference.names import REFERENCE_MODE_NAMES


class ConfigError(PrefpackError, ValueError):
    """A config file, override or value is wrong; the message names the dotted key and what was expected."""


ConfigError.__module__ = "prefpack.config"  # where users import it from (and what tracebacks name)


def _f(default: Any, help: str) -> Any:
    """A dataclass field with a one-line ``help`` (also written as a comment by ``save_config``)."""
    if isinstance(default, list | dict):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def _param(name: str) -> Any:
    """A ``loss.*`` field from the one table of loss parameters (prefpack.loss_params)."""
    p = LOSS_PARAMS[name]
    return _f(p.default, p.help)


DType = Literal["auto", "float32", "bfloat16", "float16"]
AttnImpl = Literal[ATTENTION_CHOICES]  # the model/attention folder's table
MasterDType = Literal["auto", "float32", "bfloat16"]
SaveDType = Literal["auto", "float32", "bfloat16"]
Budget = int | Literal["auto"]
Switch = bool | Literal["auto"]
Quantization = Literal["nf4", "fp4"]  # bitsandbytes' 4-bit types (engine/quantize.py)
ReferenceMode = Literal[REFERENCE_MODE_NAMES]  # the reference folder's table
KLPairing = Literal["step", "fixed"]
ScaleRewards = Literal["group", "batch", "none"]  # losses.pg.group_advantages
OldLogprobs = Literal["recompute", "sampler", "current"]  # objectives.pg
ImportanceSamplingLevel = Literal["token", "sequence"]  # losses.pg: clipped_token_terms / sequence_ratio_loss
SamplingCorrection = Literal["auto", "none", "token_truncate", "token_mask", "sequence_truncate",
                             "sequence_mask"]  # losses.pg.sampling_weights
RankedPairs = Literal["auto", "best_vs_rest", "all_pairs"]
FDivergence = Literal["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"]  # losses.F_DIVERGENCES
Schedule = Literal["cosine", "linear", "constant"]
Device = Literal["auto", "cpu", "cuda"]
Objective = Literal[OBJECTIVE_NAMES]  # the objectives folder's table (objectives/names.py)
ReportTo = Literal["tensorboard", "wandb", "mlflow", "none", "auto"]


@dataclass
class ModelConfig:
    name_or_path: str | None = _f(None, "policy weights: local folder or hub id (required for train)")
    tokenizer: str | None = _f(None, "tokenizer folder; null = the model's own, else the store's copy")
    dtype: DType = _f("auto", "compute dtype; auto = float32 on CPU, bfloat16 on CUDA (float32 master weights, "
                      "see optim.master_dtype)")
    attn_implementation: AttnImpl = _f(
        "auto", "attention kernel: auto = packed_sdpa on CPU; on CUDA flash_attention_2 if installed, else torch's "
        "varlen (half-precision compute), else sdpa")
    trust_remote_code: bool = _f(False, "run Python code the model, tokenizer or processor folder names in its config "
                                 "(auto_map); off, such a folder is refused")
    allow_tokenizer_mismatch: bool = _f(False, "train even if the store was tokenised by another tokenizer")
    gradient_checkpointing: Switch = _f("auto", "recompute activations in backward to save memory; auto = on on CUDA "
                                        "with train.memory=first (TRL's default too), off on CPU and with speed")
    compile: Switch = _f("auto", "torch.compile each decoder layer (fuses the elementwise work between matmuls; the "
                         "first step pays the compilation); auto = on in a single CUDA process, falling back to eager "
                         "where the compiler fails; off on CPU and under torchrun")
    freeze_vision: bool = _f(True, "vision-language models: no gradient for the vision encoder (as most recipes "
                             "train; with LoRA: no adapters on it); false trains it too (an error on a text model)")
    freeze_projector: bool = _f(True, "vision-language models: no gradient for the projector between vision encoder "
                                "and language model (Qwen2-VL's merger, LLaVA's multi_modal_projector; with LoRA: no "
                                "adapters on it); false trains it too (an error on a text model)")
    quantization: Quantization | None = _f(None, "hold the base weights in 4 bits (QLoRA, needs bitsandbytes and "
                                           "lora.enabled): nf4 or fp4, computed in model.dtype's compute dtype; the "
                                           "final model is LoRA merged into the de-quantised base; null = off")
    quantization_double: bool = _f(True, "with model.quantization: quantise the 4-bit blocks' scales too "
                                   "(double quantisation, about 0.4 bits a weight less)")


@dataclass
class TrainSource:
    """One store of a training mixture (``data.train`` as a list; docs/mixtures.md)."""

    path: str = field(metadata={"help": "prepared store folder"})
    weight: float | None = _f(None, "sampling proportion over the run (shares the stores' total size); "
                              "null with no pairs = 1")
    pairs: int | None = _f(None, "a fixed number of examples of this store per epoch, instead of a weight")
    name: str | None = _f(None, "the source's name in the metrics (NAME/loss, ...); null = the store folder's name")


@dataclass
class DataConfig:
    train: str | list[TrainSource] | None = _f(None, "prepared store folder to train on (required for train), or a "
                                               "mixture: a list of {path, weight} / {path, pairs} entries")
    eval: str | dict[str, str] | None = _f(None, "prepared held-out store folder, or a map {name: folder} of several "
                                           "(each logged as eval/NAME/...); null = no evaluation")
    packing: bool = _f(True, "pack several pairs into each row; false = one padded pair per row")
    max_tokens_per_row: Budget = _f("auto", "row length budget in tokens when packing; auto = 2048 on CPU, "
                                    "sized from the device on CUDA")
    pad_to_multiple_of: int | None = _f(None, "pad row length up to a multiple of this; null = no rounding")
    shuffle: bool = _f(True, "shuffle pairs every epoch (seeded by train.seed)")
    paired_as_kto: bool = _f(False, "KTO on a pair store: chosen = desirable, rejected = undesirable")
    prefix_sharing: Switch = _f("auto", "lay out each prompt once per prompt group in its packed row (a pair, a "
                                "ranked prompt's completions, KTO examples of one prompt; about 36% fewer positions "
                                "on hh); auto = on with packing on the kernels that read prompt groups "
                                "(packed_sdpa on CPU, varlen on CUDA); true = an error where no kernel reads them")
    ranked_pairs: RankedPairs = _f("auto", "pairs drawn from a ranked store (several scored completions per "
                                   "prompt): best_vs_rest = the best completion against each lower-scored one, "
                                   "all_pairs = every pair of completions whose scores differ; ties give no pair; "
                                   "auto = best_vs_rest, all_pairs for train.objective=reward")
    group_by_prompt: bool = _f(False, "pair stores: train the pairs that share a prompt as one prompt group, as a "
                               "ranked store's prompt is (the prompt and each distinct completion computed once, the "
                               "group's pairs in one step, train.global_batch_pairs counting groups: a prompt's pairs "
                               "form several groups where together they pass what the store's data settings allow "
                               "(2 x prepare's --max-length, a scored samples file's prompt + n x max_new_tokens) up "
                               "to 2048 positions, or the store's longest pair where it records neither); "
                               "pays where prompts repeat (`prepare` counts them)")


@dataclass
class LossTermConfig:
    name: str = field(metadata={"help": "loss name, see prefpack.losses.PAIR_LOSSES (and kto, apo_zero_unpaired)"})
    weight: float = _f(1.0, "multiplier of this term in the total loss (0 = log only)")


def _loss_config() -> type:
    """The ``loss`` section: its terms, one field per row of ``prefpack.loss_params.LOSS_PARAMS`` (so a new loss
    hyper-parameter is one row there, and config, validation of finiteness and ``prefpack eval``'s flags follow),
    and the options that are choices or switches rather than numbers."""
    rows = [(p.name, float if p.default is not None else float | None, _param(p.name)) for p in LOSS_PARAMS.values()]
    cls = make_dataclass("LossConfig", [
        ("terms", list[LossTermConfig], field(default_factory=lambda: [LossTermConfig("sigmoid", 1.0)],
                                               metadata={"help": "weighted loss terms summed into the training loss"})),
        *rows,
        # choices and switches, not numbers, so not rows of LOSS_PARAMS (prefpack eval has its own flags for them)
        ("f_divergence_type", FDivergence, _f(
            "reverse_kl", "f-DPO regulariser (TRL's f_divergence_type): reverse_kl = plain DPO, forward_kl, "
            "js_divergence, alpha_divergence; other than reverse_kl only with sigmoid, sigmoid_norm, hinge, ipo, "
            "exo_pair, robust, discopop (+ nll, sft)")),
        ("use_weighting", bool, _f(
            False, "WPO (Zhou et al. 2024, arXiv:2406.11827; TRL's use_weighting): weight each pair's loss by "
            "exp(mean token log p - log sum p^2) of chosen times that of rejected, from the policy, without "
            "gradient; not with aot/aot_unpaired; pair losses only")),
        ("kl_pairing", KLPairing, _f("step", "KTO KL partners: step = from the same step, fixed = seeded per store")),
        ("scale_rewards", ScaleRewards, _f("group", "train.objective=policy_gradient, GRPO's advantages: (score - group "
                                           "mean) / the group's std (group), the whole store's (batch), or none "
                                           "(Dr. GRPO); TRL's scale_rewards")),
        ("normalize_advantages", bool, _f(False, "loss rloo: centre and scale the leave-one-out advantages over the "
                                                 "store (TRL's RLOO normalize_advantages)")),
        ("mask_truncated_completions", bool, _f(False, "train.objective=policy_gradient: a completion the length "
                                                       "limit cut moves no loss (TRL's mask_truncated_completions)")),
        ("use_bias_correction_kl", bool, _f(True, "train.objective=policy_gradient, grpo family with loss.kl_coef: "
                                                  "the k3 KL per token times the ratio to the old policy (TRL 1.16's "
                                                  "use_bias_correction_kl, also on by default)")),
        ("old_logprobs", OldLogprobs, _f("recompute", "train.objective=policy_gradient, the ratio's old policy: "
                                         "recompute = the policy's own over the store before its first step (TRL), "
                                         "sampler = the sampler's recorded at generation, current = the policy's "
                                         "at each step, detached (ratio 1: exact when each sample trains once)")),
        ("importance_sampling_level", ImportanceSamplingLevel, _f(
            "token", "train.objective=policy_gradient, grpo family: the ratio to the old policy per token (GRPO) or "
            "one per completion, exp of the mean of its tokens' log-ratios, on each of its tokens (sequence: GSPO, "
            "Zheng et al. 2025, arXiv:2507.18071; TRL's importance_sampling_level; GSPO's own setup is loss grpo)")),
        ("sampling_correction", SamplingCorrection, _f(
            "auto", "train.objective=policy_gradient, grpo family: weight each token's surrogate by the ratio of the "
            "recomputed old policy to the sampler (its log-probs recorded at generation), TRL's "
            "vllm_importance_sampling_mode: per token or per completion (sequence_*), clipped to "
            "[loss.sampling_ratio_min, loss.sampling_ratio_max] (*_truncate) or dropped outside it (*_mask); auto = "
            "sequence_mask (TRL 1.16's default with vLLM) where the store holds vLLM's log-probs and "
            "loss.old_logprobs=recompute, else none")),
    ])
    cls.__module__ = __name__  # make_dataclass's own module argument needs Python 3.12
    return cls


LossConfig = _loss_config()


@dataclass
class ReferenceConfig:
    mode: ReferenceMode = _f("copy", "copy = frozen copy, adapter = LoRA base, precomputed = from store, none")
    model: str | None = _f(None, "reference weights for copy/precomputed; null = model.name_or_path")
    quantization: Quantization | None = _f(
        None, "mode copy with a full-precision policy: load the frozen reference copy's linear weights in 4 bits (nf4 "
        "or fp4, double quantisation, needs bitsandbytes), about a quarter of their memory; its log-probs differ "
        "slightly from the full-precision reference's (step 0's DPO loss is not exactly ln 2); null = as the policy")
    sync: bool = _f(False, "TR-DPO (TRL's sync_ref_model): every sync_steps optimizer steps the reference becomes "
                    "mixup_alpha * policy + (1 - mixup_alpha) * reference; mode copy only, no LoRA")
    mixup_alpha: float = _f(0.6, "TR-DPO alpha in (0, 1] (TRL's ref_model_mixup_alpha); 1 = copy the policy")
    sync_steps: int = _f(512, "TR-DPO tau: sync after every sync_steps-th optimizer step (TRL's ref_model_sync_steps)")


@dataclass
class LoraConfig:
    enabled: bool = _f(False, "train LoRA adapters instead of all weights (needs peft)")
    r: int = _f(8, "adapter rank")
    alpha: int = _f(16, "adapter scaling numerator (scale = alpha / r)")
    dropout: float = _f(0.0, "dropout on the adapter input")
    target_modules: str | list[str] = _f("all-linear", "modules to adapt: 'all-linear' or a list of names")
    adapter: str | None = _f(None, "a LoRA adapter folder to continue training (peft's save_pretrained output, e.g. "
                             "a LoRA run's final/adapter) over model.name_or_path, its own r, alpha and targets; "
                             "null = a fresh adapter")


@dataclass
class OptimConfig:
    lr: float = _f(5.0e-7, "peak learning rate (AdamW)")
    weight_decay: float = _f(0.0, "AdamW decoupled weight decay")
    betas: tuple[float, float] = _f((0.9, 0.999), "AdamW moment decay rates")
    eps: float = _f(1.0e-8, "AdamW denominator epsilon")
    schedule: Schedule = _f("cosine", "learning-rate decay after warmup")
    warmup_steps: int = _f(0, "linear warmup steps")
    warmup_ratio: float = _f(0.0, "warmup as a fraction of all steps, used when warmup_steps is 0")
    max_grad_norm: float | None = _f(1.0, "clip the global gradient norm to this; null = no clipping")
    master_dtype: MasterDType = _f(
        "auto", "dtype of the trained weights and optimizer state; auto = float32 (bfloat16 loses updates "
        "smaller than half a bf16 ulp, most of them at DPO learning rates)")


@dataclass
class TrainConfig:
    global_batch_pairs: int = _f(8, "pairs (KTO: examples) per optimizer step (over all micro-batches and ranks)")
    micro_batch_tokens: Budget = _f("auto", "token budget of one micro-batch (all its rows); auto = 4096 on CPU, "
                                    "sized from free memory and the model on CUDA")
    objective: Objective = _f("preference", "what the run trains: preference = the policy by its loss.terms (DPO family, "
                              "KTO); reward = a reward model (a sequence classifier, hidden -> 1, read at each "
                              "completion's last scored token) by the Bradley-Terry loss, no reference "
                              "(docs/reward-models.md)")
    epochs: float = _f(1.0, "passes over the training store (fractions allowed)")
    max_steps: int | None = _f(None, "optimizer steps to run; overrides epochs when set")
    seed: int = _f(0, "seed for shuffling, dropout and initialisation")
    chunk_size: Budget = _f("auto", "tokens per chunk of the memory-bounded log-softmax; auto = 1024 on CPU, "
                            "sized from the device on CUDA")
    device: Device = _f("auto", "auto = cuda when available, else cpu")
    memory: Literal["first", "speed"] = _f(
        "first", "what CUDA's free memory is for: first = a peak under TRL's default run of the same model "
        "(gradient checkpointing, 1,024-token head chunks, micro-batches of at most 16,384 tokens); speed = fill "
        "free memory (no checkpointing unless asked, budgets as large as the estimate allows)")
    activation_offloading: bool = _f(
        False, "keep the activations the policy's forward saves for backward in pinned host memory until backward "
        "(CUDA: copied out on a side stream, back when read; less device memory, slower steps; TRL's "
        "activation_offloading); composes with model.gradient_checkpointing; on CPU nothing moves")


@dataclass
class RunConfig:
    output_dir: str = _f("runs/prefpack", "folder for checkpoints, metrics and the final model")
    log_every: int = _f(1, "log train metrics every N optimizer steps")
    eval_every: int = _f(0, "evaluate every N steps; 0 = only at the end")
    save_every: int = _f(500, "checkpoint every N steps (500, TRL's default: a crashed or preempted run resumes, at "
                         "little cost); 0 = only the final model")
    keep_checkpoints: int = _f(2, "how many most recent checkpoints to keep")
    report_to: ReportTo | list[ReportTo] = _f(
        ["auto"], "where metrics go besides metrics.jsonl (always written): auto = tensorboard when installed, "
        "silently; tensorboard (refused when not installed); wandb (pip install 'prefpack[wandb]'); mlflow (pip install "
        "'prefpack[mlflow]'; RUN_DIR/mlruns unless MLFLOW_TRACKING_URI is set); none")
    wandb_project: str = _f("prefpack", "W&B project when report_to has wandb (run name = the run folder's name)")
    tensorboard: bool | None = _f(None, "older switch: true adds tensorboard to report_to, false removes it, "
                                  "null = report_to decides")
    plot: bool = _f(True, "write curves.png at the end")
    save_dtype: SaveDType = _f("auto", "dtype of the final model; auto = the dtype of the source checkpoint")


Strategy = Literal["ddp", "fsdp2"]
Balance = Literal["tokens", "count"]


@dataclass
class DistributedConfig:
    strategy: Strategy = _f("ddp", "under torchrun: ddp (model fits one device) or fsdp2 (shard it)")
    balance: Balance = _f("tokens", "ranks get micro-batches balanced by tokens, or equal pair counts packed per rank (count)")
    sequence_parallel: int = _f(1, "ranks per sequence group: each micro-batch row is split into this many token shards "
                                   "(attention by all-to-all over heads); the world is data-parallel groups of it")
    cpu_offload: bool = _f(False, "with strategy fsdp2: hold each rank's shards of the parameters, gradients and "
                                  "AdamW state (and of a reference copy) in CPU memory, the optimizer stepping on the "
                                  "CPU; fits training state larger than the GPUs, at the cost of host-device copies "
                                  "every layer and a CPU optimizer step")


RoundsEngine = Literal["transformers", "vllm"]
PairMode = Literal["best_vs_worst", "best_vs_rest", "all_pairs"]  # rewards.pairs.PAIR_MODES
RoundsReference = Literal["initial", "round_start"]
RoundsOptimizer = Literal["keep", "reset"]


@dataclass
class RoundsConfig:
    """On-policy rounds (docs/on-policy.md): each round samples the current policy, scores, trains on the pairs."""

    count: int = _f(0, "on-policy rounds; 0 = off (train on data.train); each round: generate, score, train "
                    "(data.train is then ignored: each round trains on its own store)")
    prompts: str | list[str] | None = _f(None, "prompts each round samples: a store folder, or JSONL file(s) of "
                                         "prompt / messages rows (rendered and tokenised as prepare does)")
    eval_prompts: str | list[str] | None = _f(None, "held-out prompts: sampled and scored each round, never trained "
                                              "on (the eval_reward/* metrics)")
    prompts_per_round: int = _f(0, "prompts each round samples: a seeded slice of rounds.prompts, the rounds covering "
                                "them before any repeats (docs/on-policy.md); 0 = every prompt every round")
    prompt_field: str | None = _f(None, "JSONL rows: the prompt's field; null = prompt, else messages")
    tokenizer: str | None = _f(None, "JSONL rows' tokenizer; null = the model's")
    samples_per_prompt: int = _f(4, "completions sampled per prompt (k)")
    temperature: float = _f(1.0, "sampling temperature")
    top_p: float = _f(1.0, "nucleus sampling threshold")
    max_new_tokens: int = _f(256, "longest completion; a longer one is cut and counted (cut_samples)")
    seed: int = _f(0, "sampling seed (round r samples with seed + r)")
    engine: RoundsEngine = _f("transformers", "transformers = the policy in memory; vllm = a vLLM server given each "
                              "round's policy in place (docs/on-policy.md)")
    batch_size: int = _f(8, "transformers engine: prompts per generate call; under torchrun the chunks the ranks "
                         "share (vllm too, where each rank drives servers of its own: raise it there, e.g. 256)")
    vllm_command: str | None = _f(None, "vllm: the command that serves {model} on {port} (e.g. 'vllm serve {model} "
                                  "--port {port} --worker-extension-cls prefpack.generation.vllm_worker."
                                  "PrefpackWorkerExtension'), started once per run on the initial model (a round per "
                                  "training: on each round's policy)")
    vllm_url: str | list[str] | None = _f(None, "vllm: running servers' URLs (one, or a list: prompts dealt over "
                                          "them), each given each round's policy in place; under torchrun with a "
                                          "server a rank at least, each rank drives its own; a round per training "
                                          "(rounds.in_process=false): one URL, count 1")
    reward_fn: str | None = _f(None, "scorer: path/to/file.py:function (prefpack score --reward-fn)")
    reward_timeout: float = _f(60.0, "reward_fn: the seconds one call may take, then it is stopped and the run fails "
                               "naming the row (prefpack score --reward-timeout); 0 = no limit")
    reward_model: str | None = _f(None, "scorer: a reward model folder (prefpack score --reward-model)")
    pairs: PairMode = _f("best_vs_worst", "pairs of a prompt's samples: best_vs_worst (RLHFlow's max-min), "
                         "best_vs_rest, all_pairs")
    min_gap: float = _f(0.0, "a pair's least score gap; a prompt left with no pair (a tie) is skipped and counted")
    steps_per_round: int = _f(10, "optimizer steps each round; the learning-rate schedule spans count x "
                              "steps_per_round")
    optimizer: RoundsOptimizer = _f("keep", "keep = one optimizer over every round (its moments carry on, as the "
                                    "learning-rate schedule does); reset = a fresh optimizer state at each round's "
                                    "start (RLHFlow's iterative DPO)")
    save_each_round: bool = _f(True, "true = at each round's end an evaluation (data.eval), a checkpoint and the "
                               "round's model (rounds/NNN/train/final); false = online training (a round of a few "
                               "steps): the last round's model only, checkpoints and evaluations by run.save_every / "
                               "run.eval_every")
    overlap: bool = _f(False, "vllm: round r + 1 sampled while round r trains, from round r's starting policy (a "
                       "staleness of one round, recorded in each round's samples meta); round 1 and 2 both sample the "
                       "initial policy")
    in_process: bool = _f(True, "true = every round in one training process (the policy loaded once, sampled in "
                          "memory, one optimizer); false = each round a whole training run (the policy saved and read "
                          "back, a fresh optimizer, a vLLM server started per round): what a 4-bit base, or a copied "
                          "round_start reference of LoRA, under FSDP2 still run as")
    reference: RoundsReference = _f("initial", "the reference of every round: initial = the initial policy "
                                    "(reference.model when set), round_start = the policy at the round's start")


@dataclass
class Config:
    """The whole resolved config of one run. ``validate()`` before training."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    rounds: RoundsConfig = field(default_factory=RoundsConfig)

    def loss_terms(self) -> list:
        """The terms as ``prefpack.losses.LossTerm`` objects (imports torch, hence lazily)."""
        from prefpack.losses import LossTerm

        return [LossTerm(t.name, float(t.weight)) for t in self.loss.terms]

    def needs_reference(self) -> bool:
        """Whether any loss term reads reference log-probs (a reward model's objective reads none)."""
        from prefpack.losses import PAIR_LOSSES

        objective = train_objective(self)
        if not objective.reads_reference:
            return False
        if objective.loss_names is not None:  # group policy gradients: only their KL term reads it
            return bool(self.loss.kl_coef)
        return any(t.name not in PAIR_LOSSES or PAIR_LOSSES[t.name].needs_reference for t in self.loss.terms)

    def validate(self, *, training: bool = True) -> None:
        """Check values and cross-field rules; raise one ``ConfigError`` listing every problem found.

        ``training=False`` skips the keys only ``train`` needs (``model.name_or_path``, ``data.train``) so
        ``eval`` and tests can check partial configs.
        """
        problems = rules.problems(self, training=training)
        if len(problems) == 1:
            raise ConfigError(problems[0])
        if problems:
            raise ConfigError("invalid config:\n" + "\n".join(f"  - {p}" for p in problems))

    def warnings(self) -> list[str]:
        """Allowed but probably unintended settings, for the CLI to print."""
        return rules.warnings(self)
