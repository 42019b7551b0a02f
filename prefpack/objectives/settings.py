"""What an objective reads of a run, resolved once: budgets, layout, schedule and loss parameters, with no ``auto``
left. ``training.build`` makes one from the config and the loaded model; objectives never see the config, so a
value they read cannot disagree with the one training resolved (an unresolved ``"auto"`` is truthy)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, make_dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from prefpack.loss_params import LOSS_PARAMS
from prefpack.objectives.names import train_objective

if TYPE_CHECKING:
    from prefpack.batching.vision import VisionSettings

__all__ = ["LossParams", "RunSettings", "Term", "config_terms", "settings_from_config"]


class Term(NamedTuple):
    """One weighted loss term as the config lists it (pair terms become ``losses.LossTerm`` in the objective)."""

    name: str
    weight: float = 1.0


def _loss_params() -> type:
    """Every ``loss.*`` value an objective reads: one field per row of ``LOSS_PARAMS`` (so a new parameter is one
    row there) plus the choices and switches that are not numbers."""
    rows = [(p.name, float | None) for p in LOSS_PARAMS.values()]
    extra = [("f_divergence_type", str), ("use_weighting", bool), ("kl_pairing", str), ("scale_rewards", str, "group"),
             ("normalize_advantages", bool, False), ("mask_truncated_completions", bool, False),
             ("old_logprobs", str, "recompute"), ("use_bias_correction_kl", bool, True),
             ("sampling_correction", str, "auto"), ("importance_sampling_level", str, "token")]
    extra = [(n, t) if len(rest) == 0 else (n, t, dataclasses.field(default=rest[0])) for n, t, *rest in extra]
    cls = make_dataclass("LossParams", rows + extra, frozen=True)
    cls.__module__ = __name__

    def keywords(self, reader: str) -> dict[str, Any]:
        """The keywords of ``reader``'s loss function (``"pair"``: ``preference_loss``, ``"unpaired"``:
        ``unpaired_loss``), read from the table's ``read_by`` so a call never re-lists them."""
        out = {p.name: getattr(self, p.name) for p in LOSS_PARAMS.values() if reader in p.read_by}
        if reader == "pair":
            out["f_divergence_type"] = self.f_divergence_type
        return out

    cls.keywords = keywords
    return cls


LossParams = _loss_params()


@dataclass(frozen=True)
class RunSettings:
    """A run's resolved settings as the objectives read them (see the module docstring)."""

    micro_batch_tokens: int  # tokens of one micro-batch, all its rows
    row_tokens: int  # longest packed row (data.max_tokens_per_row)
    chunk_size: int  # positions per chunk of the head's log-softmax
    packing: bool
    pad_to_multiple_of: int | None
    shares_prompts: bool  # a prompt laid out once per prompt group in its packed row (resolved data.prefix_sharing)
    pad_id: int
    global_batch: int  # examples (pairs, KTO examples, prompt groups) per optimizer step
    seed: int
    ranked_pairs: str
    paired_as_kto: bool
    loss: Any  # LossParams
    router_aux_loss_coef: float = 0.0  # resolved against the model (pair objectives only)
    # Vision-language runs (issue 27): the image token, 3-D rotary positions and the image preprocessing
    # (prefpack.batching.vision.VisionSettings); None for text runs, whose batches carry no vision fields.
    vision: VisionSettings | None = None
    micro_batch_auto: bool = False  # train.micro_batch_tokens was auto (sized for the device), not a number given

    def __post_init__(self) -> None:
        for name in ("micro_batch_tokens", "row_tokens", "chunk_size", "global_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RunSettings.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.shares_prompts, bool) or not isinstance(self.packing, bool):
            raise ValueError("RunSettings.packing and shares_prompts must be resolved booleans")
        if self.shares_prompts and not self.packing:
            raise ValueError("RunSettings: shared prompts need packed rows")

    @property
    def row_budget(self) -> int:
        """The longest a packed row may be: a row never exceeds its micro-batch."""
        return min(self.row_tokens, self.micro_batch_tokens)

    @property
    def multiple(self) -> int:
        """What a row's length is rounded up to (1: no rounding)."""
        return self.pad_to_multiple_of or 1


def settings_from_config(cfg, *, pad_id: int, micro_batch_tokens: int | None = None, row_tokens: int | None = None,
                         chunk_size: int | None = None, shares_prompts: bool | None = None,
                         router_aux_loss_coef: float = 0.0, vision: VisionSettings | None = None) -> RunSettings:
    """The settings of a config whose ``auto`` values are given here (``build`` passes what it resolved for the
    device and the kernel; a test or benchmark may pass numbers, or set them in the config). A value still
    ``auto`` is an error: the objectives must plan what training runs."""
    d, tr, lo = cfg.data, cfg.train, cfg.loss

    def given(value, key: str):
        if value == "auto" or value is None:
            raise ValueError(f"{key} is 'auto': resolve it (training.build does, from the device and the kernel) "
                             "before building objectives")
        return value

    sharing = shares_prompts if shares_prompts is not None else given(d.prefix_sharing, "data.prefix_sharing")
    params = LossParams(**{name: getattr(lo, name) for name in LOSS_PARAMS},
                        f_divergence_type=lo.f_divergence_type, use_weighting=bool(lo.use_weighting),
                        kl_pairing=lo.kl_pairing, scale_rewards=lo.scale_rewards,
                        normalize_advantages=bool(lo.normalize_advantages),
                        mask_truncated_completions=bool(lo.mask_truncated_completions),
                        old_logprobs=lo.old_logprobs, use_bias_correction_kl=bool(lo.use_bias_correction_kl),
                        sampling_correction=lo.sampling_correction,
                        importance_sampling_level=lo.importance_sampling_level)
    return RunSettings(
        micro_batch_tokens=int(given(micro_batch_tokens or tr.micro_batch_tokens, "train.micro_batch_tokens")),
        row_tokens=int(given(row_tokens or d.max_tokens_per_row, "data.max_tokens_per_row")),
        chunk_size=int(given(chunk_size or tr.chunk_size, "train.chunk_size")),
        packing=bool(d.packing), pad_to_multiple_of=d.pad_to_multiple_of,
        shares_prompts=bool(sharing) and bool(d.packing), pad_id=int(pad_id),
        global_batch=int(tr.global_batch_pairs), seed=int(tr.seed),
        ranked_pairs=ranked_pairs(cfg), paired_as_kto=bool(d.paired_as_kto), loss=params,
        router_aux_loss_coef=float(router_aux_loss_coef), vision=vision,
        micro_batch_auto=tr.micro_batch_tokens == "auto")


def ranked_pairs(cfg) -> str:
    """``data.ranked_pairs`` resolved: auto = the ``train.objective`` row's choice (``names.TRAIN_OBJECTIVES``):
    all_pairs for a reward model (InstructGPT's every pair of a ranking), else best_vs_rest."""
    if cfg.data.ranked_pairs != "auto":
        return cfg.data.ranked_pairs
    return train_objective(cfg).ranked_pairs


def config_terms(cfg) -> list[Term]:
    """The config's loss terms as :class:`Term` values."""
    return [Term(t.name, float(t.weight)) for t in cfg.loss.terms]
