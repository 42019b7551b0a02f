"""TRL 1.16's GRPOTrainer and RLOOTrainer losses, advantages and gradients on fixed tiny weights and completions:
the numbers prefpack's group policy-gradient objective is tested against (TRL stays an optional dependency: the
numbers are recorded once, here, into tests/data/trl_pg.json; tests/test_pg_trl_record.py checks the file).

Reuses the assets of benchmarks/trl_losses.py (tests/data/trl_losses/): its Llama-style toy tokenizer (BOS 0,
EOS 1, pad 2, 300 tokens), its `reference/` causal LM (2 layers, hidden 16) and `policy/` (reference + seeded
noise), and the prompts of its first 4 pairs (pairs.jsonl), tokenised by TRL itself (`_tokenize_prompts`: the
tokenizer with BOS, no chat template).

Fixed inputs (seeded, `random.Random(SEED)`): k = 4 completions per prompt, each 3-12 token ids drawn from the
non-special ids and ending with EOS, except the last completion of the last group, 12 ids without EOS (a completion
cut at max_completion_length = 12: `truncated` in the JSON); one reward per completion, where group 1's four rewards
tie and group 2 has two tied rewards. The `[tool_mask]` cases also carry a seeded 0/1 mask over some completion tokens (TRL's
`tool_mask`: tokens the model did not write, handed to TRL as a rollout's `env_mask`).

Every number comes from TRL's own code, nothing is re-implemented. Per case a trainer is built on `policy/` (float32,
CPU, sdpa, `disable_dropout=True`, `use_cpu=True`, `report_to=[]`, 16 completions per step, gradient accumulation 1,
`steps_per_generation=1`, no vLLM, so no importance-sampling correction, except in the `vllm_is` cases: there the
trainer is told it uses vLLM after it is built (`use_vllm = True`, no server to sync), and the rollout hands TRL the
sampler's per-token log-probs, the policy's own plus seeded noise (`sampler_logprobs`), so TRL recomputes the old
policy and weights the surrogate by its own importance-sampling ratio, recorded with them) with a reward function that returns the
case's fixed rewards, and in train mode:

1. `_generate_and_score_completions(rows)` builds the batch dict (left-padded prompts, right-padded completions,
   masks, advantages from the rewards, `num_items_in_batch`, `tool_mask`, the truncated completion's mask zeroed by
   `mask_truncated_completions`, RLOO's old_logps and KL-in-reward). Generation is replaced, not re-implemented:
   GRPO gets the fixed completions from a `rollout_func` (TRL's public hook), RLOO (which has none) from its instance's
   `_generate_single_turn`. `ref_model` is set to `reference/` (with TRL's fused LM head, as TRL sets up a ref model):
   with beta != 0 TRL would otherwise load its ref model from the POLICY's folder (`get_config_model_id`).
2. GRPO: `old_per_token_logps` = the reference's per-token log-probs of the completions, from TRL's own
   `_get_per_token_logps_and_entropies` on a GRPOTrainer built on `reference/` (the same ids and attention mask);
   so the ratios policy / old differ from 1 and the clipping is active on some tokens. (TRL itself leaves
   old_per_token_logps unset here, i.e. ratio 1, as generation and optimisation steps are aligned.)
   RLOO: the batch is built by an RLOOTrainer on the OLD model (`old_model`), the one that generated the completions:
   its old_logps (sequence sums) and its KL-in-reward (old - ref) are TRL's own. old_model is `reference/` for the
   beta 0 cases, the policy itself for `rloo[beta=0.05]` (TRL's on-policy path: ratio 1, so loss = -mean(A) = 0,
   as leave-one-out advantages sum to 0 per group; the gradient is not 0), and `policy_sppo/` (the third weights of
   tests/data/trl_losses) for `rloo[beta=0.05,old=policy_sppo]`, where both the ratio and the KL differ from 0/1.
3. `loss = trainer._compute_loss(trainer.model, batch)`, with the policy's per-token log-probs and entropies TRL
   computed in that call captured (a wrapper around the instance's `_get_per_token_logps_and_entropies`); the
   metrics TRL logged (`_metrics["train"]`) during 1. and 3.; then `loss.backward()` and the gradients.

Per case the JSON holds: id, trainer, config (the values the loss reads, with TRL's defaults for the others it
reads: use_bias_correction_kl is True, so GRPO's KL term is multiplied by the unclipped ratio), old_model,
rewards, advantages (TRL's, per completion), completion_mask and tool_mask (per completion over its own tokens),
num_items_in_batch (GRPO), old_/ref_/policy_per_token_logps and policy_entropies (per completion, its own tokens
only; 0.0 where TRL's mask hides a token from attention: the truncated completion under
mask_truncated_completions), old_logps and policy_logps (RLOO: TRL's float32 sequence sums), loss, clipped token
(GRPO) or sequence (RLOO) counts (low / high, as TRL's metrics define them), metrics_generate, metrics_loss, and
`grads`: for every parameter (named_parameters() order, listed with shapes in the top-level `parameters`) its L2
norm and its dot product with a seeded standard normal z, and the full flattened gradient (9 significant digits:
float32 exactly) for the parameters of at most 4096 elements (all but the embedding and the LM head). z for the
parameter at position i (0-based) of named_parameters(): `torch.randn(shape, generator=torch.Generator().
manual_seed(PROJ_SEED + i), dtype=torch.float32)`, PROJ_SEED = 1234; norm and dot are computed in float64 from
the float32 gradient. Top level: versions, command, prompts and prompt ids, completion ids, `truncated`, rewards,
the tool mask. The file is about 1.6 MB (the full gradients: 4688 numbers per case).

    PYTHONPATH=/path/to/trl-1.16:. python benchmarks/trl_pg.py      # about 10 s on 2 CPU cores
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ASSETS = REPO / "tests" / "data" / "trl_losses"
OUT = REPO / "tests" / "data" / "trl_pg.json"
SEED = 0
PROJ_SEED = 1234  # z_i = randn(shape_i, generator=Generator().manual_seed(PROJ_SEED + i)), i = named_parameters() index
FULL_GRAD_MAX = 4096  # parameters with at most this many elements get their full gradient recorded
N_PROMPTS, K = 4, 4
MAX_COMPLETION_LENGTH = 12
TRUNCATED = N_PROMPTS * K - 1  # the last completion of the last group ends without EOS

# GRPO cases: GRPOConfig values (on top of BASE_GRPO) and the extras of the inputs (tool mask)
BASE_GRPO = {"loss_type": "grpo", "beta": 0.0, "epsilon": 0.2, "epsilon_high": None, "scale_rewards": "group",
             "mask_truncated_completions": False}
GRPO_CASES = [
    ("grpo", {}),
    ("bnpo", {"loss_type": "bnpo", "scale_rewards": "batch"}),
    ("dr_grpo", {"loss_type": "dr_grpo", "scale_rewards": "none"}),
    ("dapo", {"loss_type": "dapo"}),
    ("grpo[scale_rewards=batch]", {"scale_rewards": "batch"}),
    ("dapo[scale_rewards=none]", {"loss_type": "dapo", "scale_rewards": "none"}),
    ("grpo[beta=0.04]", {"beta": 0.04}),
    ("dapo[beta=0.04]", {"loss_type": "dapo", "beta": 0.04}),
    ("grpo[beta=0.04,use_bias_correction_kl=False]", {"beta": 0.04, "use_bias_correction_kl": False}),
    ("dapo[epsilon_high=0.28]", {"loss_type": "dapo", "epsilon_high": 0.28}),
    ("grpo[epsilon=0.01]", {"epsilon": 0.01}),
    ("grpo[mask_truncated_completions]", {"mask_truncated_completions": True}),
    ("dapo[mask_truncated_completions]", {"loss_type": "dapo", "mask_truncated_completions": True}),
    ("grpo[tool_mask]", {"tool_mask": True}),
    ("dapo[tool_mask]", {"loss_type": "dapo", "tool_mask": True}),
    ("grpo[importance_sampling_level=sequence]", {"importance_sampling_level": "sequence"}),
    ("grpo[importance_sampling_level=sequence,beta=0.04]", {"importance_sampling_level": "sequence", "beta": 0.04}),
    ("dapo[importance_sampling_level=sequence,tool_mask]", {"loss_type": "dapo", "importance_sampling_level": "sequence",
                                                            "tool_mask": True}),
    # the sampler's log-probs (the policy's own plus seeded noise, SAMPLER_NOISE) handed to TRL as a vLLM rollout's:
    # TRL recomputes the old policy (the policy itself: ratio 1) and weights each token by its IS correction
    ("grpo[vllm_is=sequence_mask]", {"sampler": True, "vllm_importance_sampling_mode": "sequence_mask",
                                     "vllm_importance_sampling_clip_min": 0.8, "vllm_importance_sampling_clip_max": 1.25}),
    ("grpo[vllm_is=token_truncate,beta=0.04]", {"sampler": True, "beta": 0.04,
                                                "vllm_importance_sampling_mode": "token_truncate",
                                                "vllm_importance_sampling_clip_min": 0.97,
                                                "vllm_importance_sampling_clip_max": 1.03}),
    ("dapo[vllm_is=token_mask,importance_sampling_level=sequence]", {
        "sampler": True, "loss_type": "dapo", "importance_sampling_level": "sequence",
        "vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_min": 0.97,
        "vllm_importance_sampling_clip_max": 1.03}),
    ("grpo[vllm_is=sequence_truncate]", {"sampler": True, "vllm_importance_sampling_mode": "sequence_truncate",
                                         "vllm_importance_sampling_clip_max": 1.1}),
    # TRL 1.16's other token-level terms, and DeepSeek-V3.2's off-policy sequence mask
    ("cispo[epsilon_high=1.05]", {"loss_type": "cispo", "epsilon_high": 1.05}),
    ("cispo[epsilon_high=1.05,beta=0.04,tool_mask]", {"loss_type": "cispo", "epsilon_high": 1.05, "beta": 0.04,
                                                      "tool_mask": True}),
    ("sapo", {"loss_type": "sapo"}),
    ("sapo[beta=0.04,scale_rewards=none]", {"loss_type": "sapo", "beta": 0.04, "scale_rewards": "none"}),
    ("luspo[importance_sampling_level=sequence]", {"loss_type": "luspo", "importance_sampling_level": "sequence"}),
    ("grpo[off_policy_mask_threshold=0.03]", {"off_policy_mask_threshold": 0.03}),
    ("dapo[off_policy_mask_threshold=0.03,beta=0.04]", {"loss_type": "dapo", "off_policy_mask_threshold": 0.03,
                                                        "beta": 0.04}),
    ("dapo[vllm_is=token_truncate,off_policy_mask_threshold=0.0]", {
        "sampler": True, "loss_type": "dapo", "off_policy_mask_threshold": 0.0,
        "vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": 1.03}),
    ("cispo[importance_sampling_level=sequence,vllm_is=token_truncate]", {
        "sampler": True, "loss_type": "cispo", "epsilon_high": 1.05, "importance_sampling_level": "sequence",
        "vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": 1.03}),
]
SAMPLER_NOISE = 0.05  # std of the seeded normal noise added to the policy's log-probs as the sampler's
IS_KEYS = ("vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max")
# further GRPOConfig / RLOOConfig values the loss reads, recorded at TRL's defaults (use_bias_correction_kl: True
# multiplies GRPO's per-token KL by the unclipped ratio exp(lp - old), in the loss and in the logged kl)
ARGS_READ = {"grpo": ("use_bias_correction_kl", "importance_sampling_level", "delta", "top_entropy_quantile",
                      "entropy_coef", "off_policy_mask_threshold", "multi_objective_aggregation",
                      "reward_weights", "temperature", "sapo_temperature_pos", "sapo_temperature_neg"),
             "rloo": ("reward_clip_range", "reward_weights", "temperature")}
BASE_RLOO = {"beta": 0.0, "epsilon": 0.2, "epsilon_high": None, "normalize_advantages": False}
RLOO_CASES = [
    ("rloo", {}, "reference"),
    ("rloo[normalize_advantages]", {"normalize_advantages": True}, "reference"),
    ("rloo[beta=0.05]", {"beta": 0.05}, "policy"),
    ("rloo[beta=0.05,old=policy_sppo]", {"beta": 0.05}, "policy_sppo"),
]


def fixed_inputs(tok) -> dict:
    """The seeded completions, rewards and tool masks (completions and rewards shared by every case)."""
    rng = random.Random(SEED)
    special = set(tok.all_special_ids)
    vocab = [i for i in range(len(tok)) if i not in special]
    completions = []
    for j in range(N_PROMPTS * K):
        if j == TRUNCATED:
            completions.append([rng.choice(vocab) for _ in range(MAX_COMPLETION_LENGTH)])
        else:
            n = rng.randint(3, MAX_COMPLETION_LENGTH)
            completions.append([rng.choice(vocab) for _ in range(n - 1)] + [tok.eos_token_id])
    rewards = []
    for g in range(N_PROMPTS):
        if g == 1:  # all four tie
            rewards += [round(rng.uniform(-1, 1), 3)] * K
        elif g == 2:  # two tie
            a, b, c = (round(rng.uniform(-1, 1), 3) for _ in range(3))
            rewards += [a, b, a, c]
        else:
            rewards += [round(rng.uniform(-1, 1), 3) for _ in range(K)]
    tool_mask = []
    for ids in completions:  # a 1-3 token span the model did not write, in about half the completions of 5+ tokens
        m = [1] * len(ids)
        if len(ids) >= 5 and rng.random() < 0.5:
            start = rng.randint(1, len(ids) - 4)
            for t in range(start, start + rng.randint(1, 3)):
                m[t] = 0
        tool_mask.append(m)
    return {"completions": completions, "rewards": rewards, "tool_mask": tool_mask}


def build_trainer(kind: str, model_dir: Path, config: dict, prompts: list[str], fixed: dict, work: Path, tool: bool,
                  holder: dict):
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback

    tok = AutoTokenizer.from_pretrained(ASSETS / "tokenizer")

    def fixed_reward(completions, **kwargs):
        return list(holder["rewards"])

    common = dict(output_dir=str(work / "out"), per_device_train_batch_size=N_PROMPTS * K, num_generations=K,
                  max_completion_length=MAX_COMPLETION_LENGTH, gradient_accumulation_steps=1, steps_per_generation=1,
                  disable_dropout=True, bf16=False, use_cpu=True, report_to=[], seed=SEED, save_strategy="no",
                  logging_steps=1, disable_tqdm=True, use_vllm=False,
                  model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"}, **config)
    data = Dataset.from_dict({"prompt": prompts})
    if kind == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        def rollout(batch_prompts, trainer):
            prompt_ids = trainer._tokenize_prompts(batch_prompts)[0]
            out = {"prompt_ids": [list(p) for p in prompt_ids], "completion_ids": fixed["completions"],
                   "logprobs": fixed.get("logprobs")}
            if tool:
                out["env_mask"] = fixed["tool_mask"]
            return out

        trainer = GRPOTrainer(model=str(model_dir), reward_funcs=fixed_reward, args=GRPOConfig(**common),
                              train_dataset=data, processing_class=tok, rollout_func=rollout)
    else:
        from trl import RLOOConfig, RLOOTrainer

        trainer = RLOOTrainer(model=str(model_dir), reward_funcs=fixed_reward, args=RLOOConfig(**common),
                              train_dataset=data, processing_class=tok)
        # RLOO has no rollout hook: the generation step returns the fixed completions
        trainer._generate_single_turn = lambda prompt_ids, images, multimodal_fields: [
            list(c) for c in fixed["completions"]]
    trainer.remove_callback(PrinterCallback)
    return trainer


def sampler_logprobs(trainer, prompts: list[str], completions: list[list[int]]) -> list[list[float]]:
    """The sampler's per-token log-probs handed to TRL: the policy's own (each prompt + completion run alone, plain
    transformers) plus seeded normal noise of std SAMPLER_NOISE, as a sampler of other kernels or precision gives."""
    import torch

    prompt_ids = trainer._tokenize_prompts(prompts)[0]
    rng = random.Random(SEED + 1)
    out = []
    with torch.no_grad():
        for j, ids in enumerate(completions):
            prompt = list(prompt_ids[j // K])
            seq = torch.tensor([prompt + list(ids)])
            lp = torch.log_softmax(trainer.model(input_ids=seq).logits.float()[0, :-1], -1)
            lp = lp[torch.arange(seq.shape[1] - 1), seq[0, 1:]][len(prompt) - 1:]
            out.append([float(x) + rng.gauss(0.0, SAMPLER_NOISE) for x in lp.tolist()])
    return out


def per_completion(t, lengths: list[int]) -> list[list[float]]:
    """Rows of a right-padded [B, T] tensor cut to each completion's own length."""
    return [[float(x) for x in row[:n]] for row, n in zip(t.detach().double().tolist(), lengths)]


def run_case(kind: str, cid: str, config: dict, old_model: str, prompts, fixed, ref_trainer, work: Path) -> dict:
    import torch

    tool = bool(config.pop("tool_mask", False))
    sampler = bool(config.pop("sampler", False))
    if sampler:
        config["vllm_importance_sampling_correction"] = True
        old_model = "policy"  # TRL recomputes the old policy itself when it corrects vLLM's samples
    fixed = dict(fixed)  # this case's (the sampler's log-probs are added below)
    holder = {"rewards": fixed["rewards"]}
    trainer = build_trainer(kind, ASSETS / "policy", config, prompts, fixed, work, tool, holder)
    if sampler:  # TRL applies its IS correction only with vLLM: as if vLLM had sampled, with no server to sync
        trainer.use_vllm = True
        trainer._last_loaded_step = trainer.state.global_step
        fixed["logprobs"] = sampler_logprobs(trainer, prompts, fixed["completions"])
    ref = ref_trainer.model.eval()
    # RLOO: the batch (old_logps, KL-in-reward, advantages) is built by an RLOOTrainer on the old model, i.e. the
    # model that generated the completions; the policy's own trainer when old_model is "policy"
    gen = trainer if kind == "grpo" or old_model == "policy" else build_trainer(
        kind, ASSETS / old_model, dict(config), prompts, fixed, work, tool, holder)
    for t in {id(trainer): trainer, id(gen): gen}.values():
        if config["beta"] != 0.0:
            t.ref_model = ref  # TRL built its ref model from the policy's folder: use the reference instead
        t.model.train()  # TRL's training mode ("train" metrics, num_generations); dropout is disabled (p = 0)
        t.current_gradient_accumulation_steps = 1
        t._metrics["train"].clear()
    model = trainer.model
    assert model.dtype == torch.float32 and model.config._attn_implementation == "sdpa"
    assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    assert all(getattr(model.config, k, 0.0) == 0.0 for k in ("attention_dropout", "hidden_dropout", "dropout"))
    model.zero_grad(set_to_none=True)
    rows = [{"prompt": p} for p in prompts for _ in range(K)]
    batch = gen._generate_and_score_completions(rows)
    metrics_generate = {k: v[-1] for k, v in gen._metrics["train"].items() if v}
    gen._metrics["train"].clear()

    lengths = [len(c) for c in fixed["completions"]]
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    keep = batch["completion_ids"].size(1)
    with torch.no_grad():
        ref_logps = ref_trainer._get_per_token_logps_and_entropies(ref, input_ids, attention_mask, keep,
                                                                     batch_size=input_ids.size(0))[0]
        if "ref_per_token_logps" in batch:  # TRL's own, from trainer.ref_model: the same numbers
            assert torch.equal(batch["ref_per_token_logps"], ref_logps)
        if sampler:  # TRL's own recomputation (the policy's), which its IS ratio was taken against
            rec_old = batch["old_per_token_logps"]
        elif kind == "grpo":  # TRL leaves it unset (aligned steps): the reference's, so that ratios differ from 1
            batch["old_per_token_logps"] = rec_old = ref_logps
        else:  # the per-token values behind TRL's old_logps sums, as its generation step computed them
            rec_old = gen._get_per_token_logps_and_entropies(gen.model, input_ids, attention_mask, keep,
                                                             batch_size=input_ids.size(0))[0]
    trainer._metrics["train"].clear()

    captured = {}
    original = trainer._get_per_token_logps_and_entropies

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        captured["logps"], captured["entropies"] = out[0].detach().clone(), out[1].detach().clone()
        return out

    trainer._get_per_token_logps_and_entropies = spy
    loss = trainer._compute_loss(model, batch)
    trainer._get_per_token_logps_and_entropies = original
    metrics_loss = {k: v[-1] for k, v in trainer._metrics["train"].items() if v}
    loss.backward()

    cmask = batch["completion_mask"]
    mask = cmask * batch["tool_mask"] if "tool_mask" in batch else cmask
    adv = batch["advantages"].reshape(-1, 1)
    eps_low, eps_high = trainer.epsilon_low, trainer.epsilon_high
    if kind == "grpo" and trainer.importance_sampling_level == "sequence":  # one ratio per completion
        log_ratio = ((captured["logps"] - batch["old_per_token_logps"]) * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        ratio = torch.exp(log_ratio).reshape(-1, 1)
        low, high = ((ratio < 1 - eps_low) & (adv < 0)).sum(), ((ratio > 1 + eps_high) & (adv > 0)).sum()
    elif kind == "grpo":
        ratio = torch.exp(captured["logps"] - batch["old_per_token_logps"])
        low = ((ratio < 1 - eps_low) & (adv < 0) & mask.bool()).sum()
        high = ((ratio > 1 + eps_high) & (adv > 0) & mask.bool()).sum()
    else:
        ratio = torch.exp((captured["logps"] * cmask).sum(1) - batch["old_logps"]).reshape(-1, 1)
        low, high = ((ratio < 1 - eps_low) & (adv < 0)).sum(), ((ratio > 1 + eps_high) & (adv > 0)).sum()
    if kind == "grpo" and trainer.loss_type in ("cispo", "sapo"):  # as TRL's metrics count them (sapo: no clip)
        real = mask.bool() if ratio.shape[1] > 1 else torch.ones_like(ratio, dtype=torch.bool)
        low = torch.tensor(0)
        high = ((ratio > eps_high) & (adv > 0) & real).sum() if trainer.loss_type == "cispo" else torch.tensor(0)

    grads = []
    for i, (name, p) in enumerate(model.named_parameters()):
        g = p.grad.detach()
        z = torch.randn(p.shape, generator=torch.Generator().manual_seed(PROJ_SEED + i), dtype=torch.float32)
        entry = {"name": name, "norm": float(g.double().norm()), "dot": float((g.double() * z.double()).sum())}
        if p.numel() <= FULL_GRAD_MAX:
            entry["grad"] = [float(f"{x:.9g}") for x in g.reshape(-1).tolist()]  # 9 digits: float32 exactly
        grads.append(entry)
    model.zero_grad(set_to_none=True)

    out = {
        "id": cid, "trainer": "GRPOTrainer" if kind == "grpo" else "RLOOTrainer",
        "config": {**config, **{k: getattr(trainer.args, k) for k in ARGS_READ[kind]},
                   **({k: getattr(trainer.args, k) for k in IS_KEYS} if sampler else {}),
                   "vllm_importance_sampling_correction": sampler,
                   "epsilon_low": eps_low, "epsilon_high": eps_high,
                   "max_completion_length": MAX_COMPLETION_LENGTH, "num_generations": K, "tool_mask": tool},
        "old_model": old_model,
        "rewards": [float(x) for x in fixed["rewards"]],
        "advantages": [float(x) for x in batch["advantages"].tolist()],
        "completion_mask": [[int(x) for x in row[:n]] for row, n in zip(cmask.tolist(), lengths)],
    }
    if "tool_mask" in batch:
        out["tool_mask"] = [[int(x) for x in row[:n]] for row, n in zip(batch["tool_mask"].tolist(), lengths)]
    if "num_items_in_batch" in batch:
        out["num_items_in_batch"] = int(batch["num_items_in_batch"])
    out["old_per_token_logps"] = per_completion(rec_old, lengths)
    if sampler:
        out["sampling_per_token_logps"] = fixed["logprobs"]
        is_ratio = batch["importance_sampling_ratio"]  # TRL's: [B, T] per token, [B, 1] per completion
        out["importance_sampling_ratio"] = (per_completion(is_ratio, lengths) if is_ratio.shape[1] > 1 else
                                            [float(x) for x in is_ratio.reshape(-1).tolist()])
    out["ref_per_token_logps"] = per_completion(ref_logps, lengths)
    out["policy_per_token_logps"] = per_completion(captured["logps"], lengths)
    out["policy_entropies"] = per_completion(captured["entropies"], lengths)
    if kind == "rloo":  # TRL's float32 sequence sums (the policy's: the same product and sum as its _compute_loss)
        out["old_logps"] = [float(x) for x in batch["old_logps"].tolist()]
        out["policy_logps"] = [float(x) for x in (captured["logps"] * cmask).sum(1).tolist()]
    out["loss"] = float(loss.detach())
    out["clipped_tokens" if kind == "grpo" else "clipped_sequences"] = {"low": int(low), "high": int(high)}
    out["metrics_generate"] = metrics_generate
    out["metrics_loss"] = metrics_loss
    out["grads"] = grads
    return out


def compact_json(doc) -> str:
    """indent=1 JSON with every list of numbers on one line."""
    text = json.dumps(doc, indent=1)
    return re.sub(r"\[\s+([-0-9.eE+,\s]+?)\s+\]", lambda m: "[" + re.sub(r",\s+", ", ", m.group(1)) + "]", text)


def main() -> None:
    for k, v in {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
                 "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "CUDA_VISIBLE_DEVICES": "",
                 "TRL_EXPERIMENTAL_SILENCE": "1"}.items():
        os.environ.setdefault(k, v)
    warnings.simplefilter("ignore", FutureWarning)
    warnings.simplefilter("ignore", UserWarning)
    try:
        import trl
    except ImportError:
        raise SystemExit("TRL is not importable: PYTHONPATH=/path/to/trl-1.16:. python benchmarks/trl_pg.py") from None
    import torch
    import transformers
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(ASSETS / "tokenizer")
    pairs = [json.loads(x) for x in (ASSETS / "pairs.jsonl").read_text(encoding="utf-8").splitlines() if x.strip()]
    prompts = [p["prompt"] for p in pairs[:N_PROMPTS]]
    fixed = fixed_inputs(tok)
    cases = []
    with tempfile.TemporaryDirectory(prefix="trl_pg-") as tmp:
        work = Path(tmp)
        refs = {kind: build_trainer(kind, ASSETS / "reference", dict(BASE_GRPO if kind == "grpo" else BASE_RLOO),
                                    prompts, fixed, work, False, {"rewards": fixed["rewards"]})
                for kind in ("grpo", "rloo")}
        prompt_ids = [list(p) for p in refs["grpo"]._tokenize_prompts(prompts)[0]]
        for cid, changed in GRPO_CASES:
            cases.append(run_case("grpo", cid, {**BASE_GRPO, **changed}, "reference", prompts, fixed, refs["grpo"],
                                  work))
        for cid, changed, old_model in RLOO_CASES:
            cases.append(run_case("rloo", cid, {**BASE_RLOO, **changed}, old_model, prompts, fixed, refs["rloo"],
                                  work))
    for c in cases:
        clip = c.get("clipped_tokens") or c.get("clipped_sequences")
        print(f"  {c['id']:<36} loss {c['loss']:+.7f}  clipped low {clip['low']} high {clip['high']}")
    from transformers import AutoModelForCausalLM

    names = [(n, list(p.shape)) for n, p in AutoModelForCausalLM.from_pretrained(ASSETS / "policy").named_parameters()]
    doc = {
        "what": "TRL GRPOTrainer / RLOOTrainer _compute_loss on fixed completions of 4 prompts x 4, the policy "
                "tests/data/trl_losses/policy, old and ref log-probs from tests/data/trl_losses/reference (see "
                "benchmarks/trl_pg.py); checked by tests/test_pg_trl_record.py",
        "command": "PYTHONPATH=<trl 1.16>:. python benchmarks/trl_pg.py",
        "trl_version": trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
        "seed": SEED, "proj_seed": PROJ_SEED,
        "projection": "z_i = torch.randn(shape_i, generator=torch.Generator().manual_seed(proj_seed + i), "
                      "dtype=torch.float32) for the parameter at index i of model.named_parameters(); dot = "
                      "sum(grad.double() * z.double()), norm = grad.double().norm()",
        "full_grad_max_numel": FULL_GRAD_MAX,
        "parameters": [{"name": n, "shape": s} for n, s in names],
        "trl_setup": {"dtype": "float32", "device": "cpu", "attn_implementation": "sdpa", "disable_dropout": True,
                      "gradient_accumulation_steps": 1, "steps_per_generation": 1, "num_processes": 1,
                      "use_vllm": False, "temperature": 1.0, "mode": "train",
                      "current_gradient_accumulation_steps": 1},
        "num_generations": K, "max_completion_length": MAX_COMPLETION_LENGTH,
        "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
        "prompts": prompts, "prompt_ids": prompt_ids,
        "completion_ids": fixed["completions"], "truncated": [TRUNCATED],
        "rewards": fixed["rewards"], "tool_mask": fixed["tool_mask"],
        "cases": cases,
    }
    OUT.write_text(compact_json(doc) + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({len(cases)} cases) in {time.perf_counter() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
