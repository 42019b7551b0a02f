"""The model: `weights` (the one loading seam: a `WeightSpec` through
`load_weights`' ordered steps, the 4-bit config, a saved adapter), `load` (loading, dtype, packing-leak guard,
tokenizer checks), `attention` (the kernel table
`kernels`: one descriptor per kernel and the `auto` choice; the kernels registered with transformers:
`packed_sdpa`, `varlen`), `head` (where the body ends and the LM head begins), `logprobs` (the chunked
completion-only log-prob op), `forward` (a micro-batch to per-sequence log-probs), `checks` (the forward's load-time
self-checks against the model), `vision` (vision-language models: their parts, image features, freezing; one
model-side module per family of `prefpack.vision_families`).

Import the public API from here.
"""

from __future__ import annotations

from prefpack.lazy import lazy_exports

# Loaded on first use (prefpack.lazy): the config reads a torch-free name table from this package.
_EXPORTS = {
    "ModelError": "prefpack.model.load",
    "PACKING_LEAK_TOLERANCE": "prefpack.model.load",
    "PairSums": "prefpack.model.forward",
    "SequenceLogps": "prefpack.model.forward",
    "SequenceRewards": "prefpack.model.reward",
    "forward_module": "prefpack.model.reward",
    "is_reward_checkpoint": "prefpack.model.load",
    "is_reward_model": "prefpack.model.head",
    "sequence_rewards": "prefpack.model.reward",
    "SequenceOutput": "prefpack.model.forward",
    "TokenizerHandle": "prefpack.model.load",
    "attention_name": "prefpack.model.attention.kernels",
    "check_against_model": "prefpack.model.checks",
    "check_vision_against_model": "prefpack.model.checks",
    "Kernel": "prefpack.model.attention.kernels",
    "KERNELS": "prefpack.model.attention.kernels",
    "check_model_source": "prefpack.model.load",
    "choose_attention": "prefpack.model.attention.auto",
    "check_vocab_fits": "prefpack.model.load",
    "load_causal_lm": "prefpack.model.load",
    "kernel_named": "prefpack.model.attention.kernels",
    "kernel_of": "prefpack.model.attention.kernels",
    "FourBit": "prefpack.model.weights",
    "WeightSpec": "prefpack.model.weights",
    "four_bit_config": "prefpack.model.weights",
    "load_adapter": "prefpack.model.weights",
    "load_weights": "prefpack.model.weights",
    "packing_leak": "prefpack.model.checks",
    "pair_logps": "prefpack.model.forward",
    "pick_attention": "prefpack.model.attention.kernels",
    "pick_device": "prefpack.model.load",
    "reads_prompt_groups": "prefpack.model.attention.kernels",
    "release_freed_memory": "prefpack.model.load",
    "resolve_tokenizer": "prefpack.model.load",
    "router_aux_loss_coef": "prefpack.model.forward",
    "sequence_logps": "prefpack.model.forward",
    "sibling_leak": "prefpack.model.checks",
    "source_dtype": "prefpack.model.load",
    "split_pairs": "prefpack.model.forward",
    "uses_flash_attention": "prefpack.model.attention.kernels",
    "weights_hash": "prefpack.model.load",
    "apply_freeze": "prefpack.model.vision",
    "is_vision_language": "prefpack.model.vision",
    "lora_targets": "prefpack.model.vision",
    "vision_parts": "prefpack.model.vision",
    "wants_compile": "prefpack.model.compile",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
