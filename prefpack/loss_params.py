"""The ``loss.*`` hyper-parameters: name, default and help, in one table without torch.

The config's ``loss`` section, ``prefpack eval``'s flags and the loss registry (``prefpack.losses``, which
says which parameters each loss reads) all come from this table, so a new parameter is declared once.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LOSS_PARAMS", "LossParam"]


@dataclass(frozen=True)
class LossParam:
    name: str
    default: float | None  # None: decided at run time (router_aux_loss_coef: the model config's)
    help: str
    # which loss functions take it as a keyword: "pair" (losses.preference_loss), "unpaired" (losses.unpaired_loss);
    # none: the objective applies it itself (router_aux_loss_coef, resolved against the model)
    read_by: tuple[str, ...] = ("pair",)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


LOSS_PARAMS: dict[str, LossParam] = {p.name: p for p in (
    LossParam("beta", 0.1, "inverse temperature shared by all terms (lambda for orpo)", ("pair", "unpaired")),
    LossParam("label_smoothing", 0.0, "label-flip rate in [0, 0.5): cDPO (sigmoid, simpo), robust, exo_pair "
              "(must be > 0 there), aot"),
    LossParam("simpo_gamma", 0.5, "SimPO target reward margin"),
    LossParam("discopop_tau", 0.05, "DiscoPOP temperature of the log-ratio modulation, > 0 (TRL's discopop_tau)"),
    LossParam("f_alpha_divergence_coef", 0.5, "alpha of loss.f_divergence_type=alpha_divergence: f'(u) = "
              "(u^(alpha-1) - 1)/(alpha-1), TRL's f_alpha_divergence_coef (= 1 - the f-DPO paper's alpha); 1 = "
              "reverse_kl"),
    LossParam("ld_alpha", None, "LD-DPO (Liu et al. 2024, arXiv:2409.06411; TRL's ld_alpha): completion tokens past the "
              "shorter completion of the pair count with this weight in [0, 1] in policy and reference log-probs; "
              "null = off (1 = plain sums); pair losses only"),
    LossParam("desirable_weight", 1.0, "KTO weight of desirable examples (lambda_D)", ("unpaired",)),
    LossParam("undesirable_weight", 1.0, "KTO weight of undesirable examples (lambda_U)", ("unpaired",)),
    LossParam("router_aux_loss_coef", None, "weight of the MoE router load-balancing loss added to the pair loss "
              "(TRL's router_aux_loss_coef): null = the model config's router_aux_loss_coef, 0 = off; only for "
              "models whose config has output_router_logits (Mixtral, Qwen2/3-MoE), an error otherwise; pair "
              "losses only (not KTO)", ()),
    LossParam("epsilon", 0.2, "train.objective=policy_gradient: the ratio's lower clip, 1 - epsilon (TRL's epsilon)", ()),
    LossParam("epsilon_high", None, "train.objective=policy_gradient: the ratio's upper clip, 1 + epsilon_high; null = "
              "epsilon (DAPO's clip-higher recommends 0.28; TRL's epsilon_high)", ()),
    LossParam("kl_coef", 0.0, "train.objective=policy_gradient: weight of the KL to the reference (TRL's GRPO/RLOO "
              "beta): grpo family, the k3 estimate per token in the loss; rloo, the summed log-ratio taken off the "
              "reward; 0 = off (no reference loaded)", ()),
    LossParam("sapo_temperature_pos", 1.0, "loss sapo: the gate's temperature for tokens of positive advantage "
              "(TRL's sapo_temperature_pos)", ()),
    LossParam("sapo_temperature_neg", 1.05, "loss sapo: the gate's temperature for tokens of zero or negative "
              "advantage (TRL's sapo_temperature_neg)", ()),
    LossParam("off_policy_mask_threshold", None, "train.objective=policy_gradient, grpo family: drop the surrogate (not "
              "the KL) of a completion whose advantage is negative and whose mean log-ratio of the sampler (else "
              "the old policy) to the policy passes this (DeepSeek-V3.2's off-policy sequence mask, TRL's "
              "off_policy_mask_threshold); null = off", ()),
    LossParam("sampling_ratio_max", 3.0, "train.objective=policy_gradient with loss.sampling_correction: the sampling "
              "ratio's upper bound C_max (truncate modes clip it there, mask modes drop what passes it; TRL's "
              "vllm_importance_sampling_clip_max)", ()),
    LossParam("sampling_ratio_min", None, "train.objective=policy_gradient with loss.sampling_correction: the lower "
              "bound C_min (null = none; TRL's vllm_importance_sampling_clip_min)", ()),
    LossParam("delta", None, "train.objective=policy_gradient: cap the unclipped ratio at delta too (two-sided "
              "clipping, TRL's delta; > 1 + epsilon_high); null = off", ()),
    LossParam("max_completion_length", None, "loss dr_grpo: the constant each completion's token sum is divided by; "
              "null = the sampling's max_new_tokens where the store records it, else its longest completion", ()),
    LossParam("center_rewards_coefficient", None, "train.objective=reward: add coef * mean((r_chosen + r_rejected)^2) "
              "to the Bradley-Terry loss, so rewards stay centred on 0 (TRL's center_rewards_coefficient); null = off",
              ()),
)}
