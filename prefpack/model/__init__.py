"""The model: `load` (loading, dtype, attention choice, packing-leak guard, tokenizer checks), `attention` (the
kernels registered with transformers: `packed_sdpa`, `varlen`), `head` (where the body ends and the LM head
begins), `logprobs` (the chunked completion-only log-prob op), `forward` (a micro-batch to per-sequence log-probs).

Import the public API from here.
"""

from prefpack.model.forward import (
    PairSums,
    SequenceLogps,
    SequenceOutput,
    attention_name,
    check_against_model,
    packing_leak,
    pair_logps,
    router_aux_loss_coef,
    sequence_logps,
    split_pairs,
    uses_flash_attention,
)
from prefpack.model.load import (
    PACKING_LEAK_TOLERANCE,
    ModelError,
    TokenizerHandle,
    check_model_source,
    check_vocab_fits,
    load_causal_lm,
    load_scoring_model,
    pick_attention,
    pick_device,
    release_freed_memory,
    resolve_tokenizer,
    source_dtype,
    weights_hash,
)

__all__ = [
    "PACKING_LEAK_TOLERANCE",
    "ModelError",
    "PairSums",
    "SequenceLogps",
    "SequenceOutput",
    "TokenizerHandle",
    "attention_name",
    "check_against_model",
    "check_model_source",
    "check_vocab_fits",
    "load_causal_lm",
    "load_scoring_model",
    "packing_leak",
    "pair_logps",
    "pick_attention",
    "pick_device",
    "release_freed_memory",
    "resolve_tokenizer",
    "router_aux_loss_coef",
    "sequence_logps",
    "source_dtype",
    "split_pairs",
    "uses_flash_attention",
    "weights_hash",
]
