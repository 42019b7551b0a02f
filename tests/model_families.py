"""The architectures prefpack claims, one row each: how a tiny random model of it is built from its transformers
config, and what prefpack does with it. tests/test_model_families.py checks every row; docs/models.md's list is
written from this table (``python tests/model_families.py`` rewrites it; the test fails when it is out of date).

Statuses: ``packs`` (packed sequences and prompts laid out once give each sequence's own log-probs),
``padded-only`` (the load-time leak guard refuses packing, in one line; ``data.packing=false`` trains).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs" / "models.md"
BEGIN, END = "<!-- families: begin (generated from tests/model_families.py) -->", "<!-- families: end -->"

# hidden 32, 2 layers, 4 query heads over 2 key/value heads of 8: every row but those that say otherwise
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, max_position_embeddings=256, tie_word_embeddings=False)
SLIDING = ["sliding_attention", "full_attention"]
# Gated DeltaNet (Qwen3.5, Qwen3-Next): a linear-attention layer, then an attention layer
GDN = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
           layer_types=["linear_attention", "full_attention"])


@dataclass(frozen=True)
class Family:
    model_type: str  # transformers' model_type (AutoConfig.for_model)
    name: str  # as people call it, for the docs
    status: str  # "packs" | "padded-only"
    config: dict = field(default_factory=dict)  # on top of SMALL (``small=False``: instead of it)
    small: bool = True
    what: str = ""  # what the row exercises, for the docs
    prompts_once: bool = True  # the kernel it loads with reads prompt groups (eager fallbacks do not)
    float32_inside: bool = False  # transformers computes a part in float32 whatever the dtype: compared to 1e-6
    since: str = ""  # the transformers release that added the family (its tests skip on an older one)

    def available(self) -> bool:
        """Whether the installed transformers knows this model type."""
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        return self.model_type in CONFIG_MAPPING_NAMES


# Mamba and Falcon-Mamba: Mamba-1 blocks only, their own config names
MAMBA1 = dict(hidden_size=32, num_hidden_layers=2, state_size=8, time_step_rank=4, tie_word_embeddings=False)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)

FAMILIES: tuple[Family, ...] = (
    Family("llama", "Llama 2/3", "packs"),
    Family("qwen2", "Qwen2 / Qwen2.5", "packs"),
    Family("qwen3", "Qwen3", "packs"),
    Family("qwen3_moe", "Qwen3-MoE", "packs", MOE, what="mixture of experts"),
    Family("gemma2", "Gemma 2", "packs", dict(sliding_window=4, layer_types=SLIDING, pad_token_id=0),
           what="logit softcapping: transformers keeps it off sdpa, eager packs it (no prompts once)",
           prompts_once=False, float32_inside=True),  # eager's softmax
    Family("gemma3_text", "Gemma 3 (text)", "packs", dict(sliding_window=4, layer_types=SLIDING, pad_token_id=0),
           what="sliding-window layers"),
    Family("mistral", "Mistral", "packs", dict(sliding_window=4), what="sliding window"),
    Family("mixtral", "Mixtral", "packs", dict(num_local_experts=4, num_experts_per_tok=2),
           what="mixture of experts"),
    Family("phi3", "Phi-3 / Phi-4", "packs", dict(pad_token_id=0)),
    Family("olmo2", "OLMo 2", "packs"),
    Family("smollm3", "SmolLM3", "packs", dict(no_rope_layers=[1, 0], pad_token_id=0), what="a layer without rotary positions"),
    Family("gpt_oss", "gpt-oss", "packs",
           dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=4, layer_types=SLIDING),
           what="attention sinks, sliding-window layers, mixture of experts"),
    Family("llama4_text", "Llama 4 (text)", "packs",
           dict(attention_chunk_size=4, floor_scale=4, no_rope_layers=[1, 0], num_local_experts=2,
                intermediate_size_mlp=64, interleave_moe_layer_step=1),
           what="chunked local attention, a NoPE layer with query temperature, mixture of experts",
           float32_inside=True),  # its rotary embedding and router
    # hybrids: recurrent layers start each packed sequence from a zero state (prefpack/model/recurrent/)
    Family("qwen3_5_text", "Qwen3.5 (text)", "packs", GDN, what="Gated DeltaNet linear-attention layers"),
    Family("qwen3_next", "Qwen3-Next", "packs",
           dict(**GDN, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=32, mlp_only_layers=[0, 1]),
           what="Gated DeltaNet linear-attention layers"),
    Family("nemotron_h", "Nemotron-H", "packs",
           dict(mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=2, chunk_size=8,
                layers_block_type=["linear_attention", "full_attention"]),
           what="Mamba-2 state-space layers", float32_inside=True),  # transformers returns its logits in float32
    Family("granitemoehybrid", "Granite 4 hybrid", "packs",
           dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=2, mamba_chunk_size=8,
                layer_types=["mamba", "attention"], num_local_experts=0, shared_intermediate_size=64),
           what="Mamba-2 state-space layers"),
    Family("jamba", "Jamba", "packs",
           dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=100, expert_layer_offset=50,
                num_experts=1, mamba_d_state=8, mamba_dt_rank=4),
           what="Mamba-1 layers"),
    Family("mamba", "Mamba", "packs", MAMBA1, small=False, what="Mamba-1 layers only (no attention)",
           float32_inside=True),  # transformers returns its logits in float32
    Family("falcon_mamba", "Falcon-Mamba", "packs", MAMBA1, small=False,
           what="Mamba-1 layers with normed B, C and time steps (no attention)", float32_inside=True),  # its logits
    Family("mamba2", "Mamba-2", "packs",
           dict(hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, state_size=8, n_groups=2, chunk_size=8,
                tie_word_embeddings=False), small=False, what="Mamba-2 layers only (no attention)",
           float32_inside=True),  # its logits, in float32
    Family("falcon_h1", "Falcon-H1", "packs",
           dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8,
                mamba_chunk_size=8), what="Mamba-2 heads beside attention in every layer"),
    Family("lfm3", "LFM3", "packs", dict(layer_types=["conv", "full_attention"], sliding_window=4, pad_token_id=0, bos_token_id=1,
                                            eos_token_id=2),
           what="short gated convolutions"),
    Family("zamba2", "Zamba2", "packs",
           dict(mamba_d_state=8, n_mamba_heads=4, mamba_ngroups=2, chunk_size=8, layers_block_type=["mamba", "hybrid"],
                num_mem_blocks=1), what="Mamba-2 layers and a shared attention block"),
    Family("kimi_linear", "Kimi-Linear", "packs",
           dict(SMALL, num_key_value_heads=4, linear_head_dim=8, linear_num_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                v_head_dim=8, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                layer_types=["linear_attention", "full_attention"], pad_token_id=0, bos_token_id=1, eos_token_id=2),
           small=False, what="KDA linear-attention layers"),
    # transformers 5.24's decoder families
    Family("exaone", "EXAONE (3.x)", "packs", since="5.24", what="plain decoder (transformers runs it as Llama)"),
    Family("apertus1p5_text", "Apertus 1.5 (text)", "packs", since="5.24", what="xIELU activation"),
    Family("sarvam_mla", "Sarvam (MLA)", "packs",
           dict(SMALL, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                qk_nope_head_dim=8, v_head_dim=8), small=False,
           since="5.24",
           what="multi-head latent attention, mixture of experts (transformers runs it as DeepSeek-V3)"),
    Family("sarvam_moe", "Sarvam-MoE", "packs",
           dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                first_k_dense_replace=1),
           since="5.24", what="mixture of experts, query/key norms (transformers runs it as GLM-4-MoE)"),
    Family("dory", "Dory", "packs",
           dict(SMALL, num_hidden_layers=3, n_input_layers=1, n_output_layers=1, n_recurrent_loops=2, sliding_window=4,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"]), small=False,
           float32_inside=True,  # its head computes the logits in float32
           since="5.24",
           what="a looped normalized transformer (nGPT): a middle layer run twice, a per-token logit scale"),
    Family("lara_mini", "Lara-4-Mini", "packs",
           dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                max_position_embeddings=256, tie_word_embeddings=False, sliding_window=4,
                linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                layer_types=["linear_attention", "sliding_attention", "full_attention"], num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16), small=False,
           since="5.24", what="Gated DeltaNet, sliding-window and NoPE attention layers, mixture of experts"),
    Family("inkling2_loop_text", "Inkling-2 Loop (text)", "padded-only",
           dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=4,
                d_rel=4, rel_extent=8, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                n_layers_per_attn_res_block=1, loop_layer_index_start=1, loop_layer_index_end=3, loop_num_passes=2,
                loop_gate_rank=4, layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
                unpadded_vocab_size=300, max_position_embeddings=256, tie_word_embeddings=False), small=False,
           since="5.24", what="its short convolutions (static, and dynamic ones on keys and values) run across the "
                                "packed row: no boundary-aware path for them yet"),
    Family("bloom", "BLOOM", "padded-only", dict(hidden_size=32, n_head=4, n_layer=2), small=False,
           what="ALiBi attention reads no position ids, so packed sequences would see each other"),
)


def render() -> str:
    """The docs list of the table, grouped by status."""
    lines = [BEGIN, "", "| family | `model_type` | packed | prompts once | tested for |", "|---|---|---|---|---|"]
    for f in FAMILIES:
        packs = f.status == "packs"
        lines.append(f"| {f.name} | `{f.model_type}` | {'yes' if packs else 'no: padded only'} | "
                     f"{'yes' if packs and f.prompts_once else 'no'} | {f.what or 'plain decoder'}"
                     f"{f' (transformers >= {f.since})' if f.since else ''} |")
    return "\n".join([*lines, "", END])


def write_docs() -> None:
    text = DOCS.read_text(encoding="utf-8")
    DOCS.write_text(re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: render(), text, flags=re.S),
                    encoding="utf-8")


if __name__ == "__main__":
    write_docs()
