"""Every architecture prefpack claims (tests/model_families.py), as a tiny random model built from its transformers
config and loaded as training loads it: packed log-probs equal each sequence run alone through the HF model (the
family's own attention, float64 sums), prompts laid out once equal prompts repeated, and the load-time leak guard
refuses what does not pack. gpt-oss (sinks, sliding windows) and Llama 4 (chunked attention, a NoPE layer's query
temperature) also on the varlen kernel's path and in a training step against the padded one. docs/models.md lists
the table."""

from __future__ import annotations

import pytest
import torch
from model_families import FAMILIES, SMALL, render
from test_packing import VOCAB, random_pairs

from prefpack.batching.collate import collate_packed, collate_padded
from prefpack.model import ModelError, load_causal_lm, sequence_logps

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")
PACKS = [f for f in FAMILIES if f.status == "packs"]
PADDED_ONLY = [f for f in FAMILIES if f.status == "padded-only"]
ROWS = [[0, 1, 2], [3, 4]]  # two packed rows: sequences at offsets well past the chunk size and window (4)


def _config(family):
    from transformers import AutoConfig

    if not family.available():
        pytest.skip(f"{family.model_type} needs transformers >= {family.since}")
    return AutoConfig.for_model(family.model_type, vocab_size=VOCAB, **(SMALL if family.small else {}),
                                **family.config)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A folder per family with its tiny random float32 model, written once."""
    from transformers import AutoModelForCausalLM

    root, paths = tmp_path_factory.mktemp("families"), {}

    def path(family) -> str:
        if family.model_type not in paths:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(_config(family))
            with torch.no_grad():  # sinks and norms start at constants: move every weight off them
                for p in model.parameters():
                    p.add_(0.1 * torch.randn_like(p))
            model.save_pretrained(root / family.model_type)
            paths[family.model_type] = str(root / family.model_type)
        return paths[family.model_type]

    return path


def _float64(model):
    """float64 in eval mode; experts on transformers' loop (its grouped matmul takes no float64)."""
    model = model.double().eval()
    if getattr(model, "_can_set_experts_implementation", lambda: False)():
        model.set_experts_implementation("eager")
    return model


def _tolerance(family) -> dict:
    """float64 throughout, but where transformers runs a part in float32 whatever the dtype (eager's softmax, Llama
    4's rotary embedding) a float64 difference of 1e-16 can flip a float32 rounding: 1e-6 there."""
    return dict(rtol=1e-6, atol=1e-6) if family.float32_inside else dict(rtol=1e-9, atol=1e-9)


def _ours(path: str, attn: str = "packed_sdpa"):
    return _float64(load_causal_lm(path, attn_implementation=attn, device=CPU, dtype=torch.float32))


def _alone(path: str, pairs) -> torch.Tensor:
    """[2 * pairs]: each chosen / rejected completion's log-prob sum, the sequence run alone through the HF model on
    transformers' own attention (sdpa, or eager where the family has no sdpa), in float64."""
    from transformers import AutoModelForCausalLM

    model = _float64(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    sums = []
    with torch.no_grad():
        for pair in pairs:
            prompt = torch.as_tensor(pair.prompt.astype("int64"))
            for completion in (pair.chosen, pair.rejected):
                ids = torch.cat([prompt, torch.as_tensor(completion.astype("int64"))])
                logp = model(input_ids=ids[None], use_cache=False).logits[0, :-1].double().log_softmax(-1)
                scored = logp[len(prompt) - 1:].gather(-1, ids[len(prompt):, None])
                sums.append(scored.sum())
    return torch.stack(sums)


@pytest.fixture(scope="module")
def pairs():
    return random_pairs(5, seed=3)


@pytest.mark.parametrize("family", PACKS, ids=lambda f: f.model_type)
def test_packed_equals_alone_and_prompts_once_equals_repeated(family, saved, pairs):
    path = saved(family)
    model = _ours(path)
    order = [p for row in ROWS for p in row]
    expected = _alone(path, [pairs[p] for p in order])
    with torch.no_grad():
        packed = sequence_logps(model, collate_packed(pairs, ROWS), chunk_size=16).logp_sum
        torch.testing.assert_close(packed, expected, **_tolerance(family))
        if family.prompts_once:
            shared = sequence_logps(model, collate_packed(pairs, ROWS, share_prompts=True), chunk_size=16).logp_sum
            torch.testing.assert_close(shared, expected, **_tolerance(family))


def _value_and_grads(model, batch, **kwargs):
    model.zero_grad(set_to_none=True)
    out = sequence_logps(model, batch, chunk_size=16, **kwargs).logp_sum
    chosen, rejected = out[0::2], out[1::2]
    (-torch.nn.functional.logsigmoid(0.1 * (chosen - rejected)).sum() + 0.01 * out.sum()).backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", ["gpt_oss", "llama4_text"])
def test_new_attention_families_on_varlen_and_in_a_training_step(model_type, saved, pairs):
    """varlen's flattened row (CPU reference path, prompts once too) gives the same sums; a training step's values
    and gradients packed equal the padded step's (``data.packing=false``), sinks' and routers' gradients included."""
    family = next(f for f in FAMILIES if f.model_type == model_type)
    path = saved(family)
    order = [p for row in ROWS for p in row]
    expected = _alone(path, [pairs[p] for p in order])
    varlen = _ours(path, "varlen")
    with torch.no_grad():
        for share in (False, True):
            out = sequence_logps(varlen, collate_packed(pairs, ROWS, share_prompts=share), chunk_size=16)
            torch.testing.assert_close(out.logp_sum, expected, **_tolerance(family))
    model = _ours(path)
    packed_v, packed_g = _value_and_grads(model, collate_packed(pairs, ROWS))
    padded_v, padded_g = _value_and_grads(model, collate_padded(pairs, order, pad_to_multiple_of=8))
    torch.testing.assert_close(packed_v, padded_v, **_tolerance(family))
    assert packed_g.keys() == padded_g.keys() and any("sinks" in n or "router" in n for n in packed_g)
    for name in packed_g:
        torch.testing.assert_close(packed_g[name], padded_g[name], **_tolerance(family), msg=name)


@pytest.mark.parametrize("family", PADDED_ONLY, ids=lambda f: f.model_type)
def test_leak_guard_refuses_what_does_not_pack(family, saved):
    path = saved(family)
    # attention that reads no positions (ALiBi), or a recurrent layer without sequence boundaries (Jamba's Mamba-1)
    with pytest.raises(ModelError, match=r"(attend to each other|recurrent layers prefpack cannot keep).*"
                                         r"data\.packing=false"):
        load_causal_lm(path, attn_implementation="packed_sdpa", device=CPU, dtype=torch.float32)
    load_causal_lm(path, attn_implementation="packed_sdpa", device=CPU, dtype=torch.float32, packed=False)


def test_a_kernel_that_drops_sinks_or_chunks_is_refused(saved):
    """flash_attention_2 would silently leave out gpt-oss's sinks (transformers passes them only to kernels that
    take them); transformers' sdpa masks count Llama 4's chunks from the packed row's start (packed sums then move
    by about 1e-4, which the leak guard does not see): refused in one line naming the kernels that compute them;
    the padded layout keeps sdpa for Llama 4."""
    from transformers import AutoModelForCausalLM

    from prefpack.model.attention import features
    from prefpack.model.attention.kernels import kernel_named

    gpt_oss, llama4 = (next(f for f in FAMILIES if f.model_type == t) for t in ("gpt_oss", "llama4_text"))
    model = AutoModelForCausalLM.from_pretrained(saved(gpt_oss), attn_implementation="eager")
    assert features.unsupported(model, kernel_named("packed_sdpa")) is None
    message = features.unsupported(model, kernel_named("flash_attention_2"), packed=False)
    assert "attention sinks" in message and "model.attn_implementation=varlen" in message
    with pytest.raises(ModelError, match=r"chunked local attention.*'sdpa'.*row's start.*varlen or packed_sdpa"):
        load_causal_lm(saved(llama4), attn_implementation="sdpa", device=CPU, dtype=torch.float32)
    load_causal_lm(saved(llama4), attn_implementation="sdpa", device=CPU, dtype=torch.float32, packed=False)
    # sequence parallelism splits the heads over ranks, and the sinks are not split with them: refused at start
    from prefpack.model.sharded import check_model
    from prefpack.sequence_parallel import SequenceParallelError

    class TwoShards:
        size, enabled = 2, True

    with pytest.raises(SequenceParallelError, match=r"attention sinks .*distributed.sequence_parallel=1"):
        check_model(_ours(saved(gpt_oss)), TwoShards())


def test_docs_list_matches_the_table():
    from model_families import DOCS

    assert render() in DOCS.read_text(encoding="utf-8"), "run: python tests/model_families.py"
