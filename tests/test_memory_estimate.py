"""The estimated peak per device (``engine/memory.py``) and the ``auto`` budgets built on it (issue 41 item 5): each
part written out by hand for a tiny Llama in each way of holding it (full fine-tuning, LoRA over a 4-bit base, FSDP2
CPU offload, activation offloading) equals what the code says, and on a fixed (simulated) GPU the micro-batch grows
when 4-bit weights shrink what the run holds. Also: CPU offload loads the weights into host memory."""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest
import torch
import transformers as tf

from prefpack.engine import budgets as b
from prefpack.engine.memory import Holding, estimate_memory, static_bytes

H, INTER, LAYERS, HEADS, KV, V = 32, 64, 2, 4, 2, 600  # conftest.tiny_llama's shape
CUDA = torch.device("cuda")
BF16 = Holding(compute=torch.bfloat16, autocast=True)


def _config() -> tf.LlamaConfig:
    return tf.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=INTER, num_hidden_layers=LAYERS,
                          num_attention_heads=HEADS, num_key_value_heads=KV, tie_word_embeddings=False)


def _llama() -> tf.LlamaForCausalLM:
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(_config())


# the parameters by hand: untied embeddings and head, per layer q/o (H x H), k/v (H x KV heads of H/HEADS), the MLP's
# three H x INTER matrices and two norms; a final norm
KV_DIM = KV * H // HEADS
LINEARS = [H * H, H * KV_DIM, H * KV_DIM, H * H, H * INTER, H * INTER, INTER * H]  # q k v o gate up down
LAYER = sum(LINEARS) + 2 * H
ROOT = 2 * V * H + H
PARAMS = ROOT + LAYERS * LAYER


def _per_token(offloaded=False, autocast=False) -> int:
    """Activations a token keeps (engine/budgets.py's doc): per layer 20H + 8I bytes in float32 (34H + 10I under
    autocast); all layers, or two with activation offloading."""
    per_layer = 34 * H + 10 * INTER if autocast else 20 * H + 8 * INTER
    return (2 if offloaded else LAYERS) * per_layer


def _head(chunk) -> int:
    return chunk * V * 8  # a chunk's logits, 8 bytes each at their peak


def test_full_fine_tuning_with_a_reference_copy():
    policy, reference = _llama(), _llama().requires_grad_(False)
    assert sum(p.numel() for p in policy.parameters()) == PARAMS  # the hand count is the model's
    est = estimate_memory(policy, reference, Holding(), activation_per_token=_per_token(), micro_batch_tokens=4096,
                          chunk_size=1024)
    assert (est.weights, est.grads, est.optimizer) == (2 * 4 * PARAMS, 4 * PARAMS, 8 * PARAMS)
    assert est.activations == 4096 * LAYERS * (20 * H + 8 * INTER) + _head(1024)
    assert est.total == 20 * PARAMS + est.activations  # two copies of the weights, gradients, AdamW
    # under bfloat16 autocast backward also keeps a bfloat16 copy of each trained float32 weight
    assert static_bytes(policy, None, BF16) == (4 * PARAMS + 2 * PARAMS, 4 * PARAMS, 8 * PARAMS)
    line = est.describe(CUDA)
    assert line.startswith("estimated peak per device (cuda; an estimate") and "4,096-token micro-batches" in line


def test_a_reward_model_has_no_vocabulary_head_term():
    """A reward model (one-label classifier) ends at its ``score`` head: no chunk of vocabulary logits is counted."""
    torch.manual_seed(0)
    rm = tf.LlamaForSequenceClassification(tf.LlamaConfig(**{**_config().to_dict(), "num_labels": 1}))
    est = estimate_memory(rm, None, Holding(), activation_per_token=_per_token(), micro_batch_tokens=4096,
                          chunk_size=1024)
    assert est.activations == 4096 * LAYERS * (20 * H + 8 * INTER)


def _four_bit_bytes(n: int) -> int:
    """A Linear4bit of ``n`` weights, NF4 with double quantisation: two weights a byte; a uint8 scale per block of 64
    and that scale's own float32 scale per 256 blocks; the 16-value NF4 table, the 256-value table of the scales'
    quantisation and their float32 offset."""
    blocks = math.ceil(n / 64)
    return n // 2 + blocks + 4 * math.ceil(blocks / 256) + 4 * 16 + 4 * 256 + 4


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory):
    """LoRA (r=4 on q_proj and v_proj) over the same tiny Llama, its base in bfloat16 and in 4 bits."""
    pytest.importorskip("bitsandbytes")
    peft = pytest.importorskip("peft")
    from prefpack.model.load import one_cpu_kernel

    path = tmp_path_factory.mktemp("estimate") / "llama"
    _llama().save_pretrained(path)
    q = tf.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16)
    four = tf.AutoModelForCausalLM.from_pretrained(path, quantization_config=q, dtype=torch.bfloat16,
                                                   device_map={"": "cpu"})
    one_cpu_kernel(four)
    plain = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # peft 0.21 reads transformers' deprecated name (as engine/lora.py)
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*is deprecated", category=FutureWarning)
        return {"plain": peft.get_peft_model(plain, lora), "four": peft.get_peft_model(four, lora)}


ADAPTERS = LAYERS * 4 * ((H + H) + (H + KV_DIM))  # r x (in + out) for q_proj and v_proj of each layer


def test_four_bit_lora(lora_models):
    est = estimate_memory(lora_models["four"], None, BF16, activation_per_token=_per_token(autocast=True),
                          micro_batch_tokens=4096, chunk_size=1024)
    linear = LAYERS * sum(_four_bit_bytes(n) for n in LINEARS)
    others = 2 * (ROOT + LAYERS * 2 * H)  # embeddings, head and norms stay bfloat16
    # float32 adapters and their bfloat16 autocast copies; gradients and AdamW moments for the adapters only
    assert est.weights == linear + others + 4 * ADAPTERS + 2 * ADAPTERS
    assert (est.grads, est.optimizer) == (4 * ADAPTERS, 8 * ADAPTERS)
    assert est.activations == 4096 * LAYERS * (34 * H + 10 * INTER) + _head(1024)
    plain = static_bytes(lora_models["plain"], None, BF16)
    assert plain[0] == 2 * PARAMS + 6 * ADAPTERS and plain[1:] == (est.grads, est.optimizer)


def test_budget_grows_when_four_bit_weights_shrink_on_a_fixed_device(lora_models, monkeypatch):
    """The same simulated GPU (nothing of the run on it yet): the free memory is set so that LoRA over the bfloat16
    base gets exactly 5 x 1,024 tokens; the 4-bit base leaves more room, so its micro-batch is larger, as written
    out from the hand-counted bytes."""
    per_token = _per_token(autocast=True)
    plain_static = 2 * PARAMS + 6 * ADAPTERS + 12 * ADAPTERS
    four_static = LAYERS * sum(_four_bit_bytes(n) for n in LINEARS) + 2 * (ROOT + LAYERS * 2 * H) + 18 * ADAPTERS
    free = plain_static + math.ceil(6 * 1024 * per_token / 0.6) - 64  # just short of 6 x 1,024 tokens
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * 2**30))
    auto = (SimpleNamespace(micro_batch_tokens="auto", chunk_size="auto"), SimpleNamespace(max_tokens_per_row="auto"))
    # memory first's cap (16,384) and floor (4,096) do not bind here: the rule counts what the weights hold
    got = {name: b.resolve_budgets(*auto, model, CUDA, autocast=True, checkpointing=False, flattened=True,
                                   memory_first=True, holding=BF16)[0].micro_batch_tokens
           for name, model in lora_models.items()}
    assert got["plain"] == 5 * 1024
    assert got["four"] == int((free - four_static) * 0.6 // per_token) // 1024 * 1024 > got["plain"]


def test_fsdp2_sharding_and_cpu_offload():
    """Two ranks: shards of 1/2 plus what is gathered in flight (the root group, two decoder layers); with CPU
    offload only what is in flight and one layer's gradients stay on the device, the optimizer state none."""
    policy, reference = _llama(), _llama().requires_grad_(False)
    sharded = Holding(world=2, sharded=True)
    in_flight = 4 * (ROOT + 2 * LAYER)
    assert static_bytes(policy, None, sharded) == (4 * PARAMS // 2 + in_flight, 4 * PARAMS // 2 + 4 * LAYER,
                                                  8 * PARAMS // 2)
    offload = Holding(world=2, sharded=True, cpu_offload=True)
    assert static_bytes(policy, reference, offload) == (2 * in_flight, 4 * LAYER, 0)
    # FSDP2's mixed precision gathers the layers in bfloat16
    mixed = Holding(compute=torch.bfloat16, world=2, sharded=True, cast_per_layer=True, cpu_offload=True)
    assert static_bytes(policy, None, mixed) == (2 * (ROOT + 2 * LAYER), 4 * LAYER, 0)


def test_activation_offloading_keeps_two_layers_per_token():
    policy = _llama()
    config = policy.config
    kept = b.activation_bytes_per_token(config, autocast=False, checkpointing=False)
    moved = b.activation_bytes_per_token(config, autocast=False, checkpointing=False, offloaded=True)
    assert (kept, moved) == (_per_token(), _per_token(offloaded=True))
    est = estimate_memory(policy, None, Holding(), activation_per_token=moved, micro_batch_tokens=8192, chunk_size=512)
    assert est.activations == 8192 * 2 * (20 * H + 8 * INTER) + _head(512)


def test_cpu_offload_loads_the_weights_into_host_memory(monkeypatch):
    """distributed.cpu_offload: the policy and a reference copy load on the CPU, not each rank's GPU (where a whole
    copy would sit before sharding); a kernel that needs CUDA to load still loads there; without offload, the GPU."""
    import prefpack.model.weights as seam
    from prefpack.engine.core import Engine
    from prefpack.engine.offload import OffloadStage
    from prefpack.precision import Precision

    loads = []
    monkeypatch.setattr(seam, "load_causal_lm", lambda path, **kw: loads.append(kw["device"]))
    cfg = SimpleNamespace(distributed=SimpleNamespace(cpu_offload=True), data=SimpleNamespace(packing=True),
                          model=SimpleNamespace(trust_remote_code=False), train=SimpleNamespace(objective="preference"))
    parallel = SimpleNamespace(dist=SimpleNamespace(enabled=True))
    engine = Engine(cfg, parallel, CUDA, precision=Precision(torch.float32, torch.bfloat16), attn="varlen")
    OffloadStage().apply(engine, log=lambda m: None)
    engine.load_like_policy("policy")
    engine.attn = "flash_attention_2"
    engine.load_like_policy("policy")
    cfg.distributed.cpu_offload = False
    plain = Engine(cfg, parallel, CUDA, precision=Precision(torch.float32, torch.bfloat16), attn="varlen")
    OffloadStage().apply(plain, log=lambda m: None)
    plain.load_like_policy("policy")
    assert loads == [torch.device("cpu"), CUDA, CUDA]
