"""2 ranks equal 1 for the architectures of issue 38 (tests/model_families.py): each family's tiny random model
(2 layers, hidden 32, from its transformers config; Lara-4-Mini 3) trains STEPS (2) steps packed with prompts laid out once, in one process
(in this one) and on 2 gloo ranks under DDP (all in one torchrun launch), and two under FSDP2: Qwen3.5 (its
recurrent layers' forwards replaced per instance, prefpack/model/recurrent/install.py, inside FSDP2's wrapped
layers) and Jamba (its decoder layers' relaying class, prefpack/model/recurrent/relay.py, beneath FSDP2's own
class swap), Jamba also with activation checkpointing (the relay's replay in backward, under FSDP2): the same
per-step losses and gradient norms and the same final weights. Issue 52 adds transformers 5.24's hybrid Lara-4-Mini
(Gated DeltaNet, sliding-window and NoPE attention, mixture of experts), under DDP and FSDP2: launched where the
installed transformers knows it, its cases skipped on an older one."""

from __future__ import annotations

import pytest
import torch
from conftest import final_weights, metrics_lines, prepare_hh_splits, run_here, run_prefpack
from model_families import FAMILIES, SMALL

NAMES = ["qwen3_5_text", "qwen3_next", "nemotron_h", "granitemoehybrid", "gpt_oss", "llama4_text", "jamba",
         "falcon_h1", "kimi_linear", "lara_mini"]
# under fully_shard: Gated DeltaNet layers whose forward prefpack replaces; Jamba's Mamba-1 layers, reached through
# their decoder layer's relaying class (FSDP2 subclasses it again), without and with activation checkpointing;
# Lara-4-Mini's Gated DeltaNet (replaced per instance too) between sliding-window attention and expert layers
FSDP2 = {"fsdp2": ("qwen3_5_text", "jamba", "lara_mini"), "fsdp2-ckpt": ("jamba",)}
STRATEGY = {"fsdp2": ["distributed.strategy=fsdp2"],
            "fsdp2-ckpt": ["distributed.strategy=fsdp2", "model.gradient_checkpointing=true"]}
STEPS = 2
# Same tolerances as tests/test_distributed.py: the two ranks' gradients are summed by an all-reduce in another
# order than one process sums them (float32 rounding, ~1e-8 after a few AdamW steps at lr 1e-3, eps 1e-3); a pair
# lost or counted twice, or a state leaking across a rank's packed sequences, moves the weights by ~1e-4 or more.
ATOL = 1e-5
SETTINGS = ["optim.lr=1.0e-3", "optim.eps=1.0e-3", "optim.warmup_steps=0", f"train.max_steps={STEPS}",
            "train.global_batch_pairs=4", "train.micro_batch_tokens=160", "data.max_tokens_per_row=160",
            "data.prefix_sharing=true", "model.attn_implementation=packed_sdpa", "run.plot=false",
            "run.tensorboard=false", f"run.save_every={STEPS + 1}",
            # MoE load balancing is a function of one forward's tokens (TRL's, per micro-batch), so it moves with how
            # a step is cut into micro-batches, ranks included (~2e-6 here, as much as a one-process run with another
            # micro-batch budget): off, so that the comparison is about what must not move
            "loss.router_aux_loss_coef=0"]


def _family(name):
    return next(f for f in FAMILIES if f.model_type == name)


# the families this transformers knows (a row with ``since`` newer than it is left out of the launches, its cases skip)
RUNS = [n for n in NAMES if _family(n).available()]


def _case(strategy, name):
    family = _family(name)
    return pytest.param(strategy, name, marks=pytest.mark.skipif(
        not family.available(), reason=f"{name} needs transformers >= {family.since}"))


@pytest.fixture(scope="module")
def world(tmp_path_factory, toy_tokenizers, hh_train):
    """A small pair store of the toy tokenizer, and each family's tiny random model with its vocabulary."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("famranks")
    tok_dir = toy_tokenizers["llama"]
    store = prepare_hh_splits(root, tok_dir, hh_train, {"train": 8}, max_length=40)["train"]
    vocab = len(AutoTokenizer.from_pretrained(tok_dir))
    models = {}
    for name in RUNS:
        family = _family(name)
        torch.manual_seed(0)
        small = SMALL if family.small else {}  # Kimi-Linear's row carries its own sizes
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(name, vocab_size=vocab, **small,
                                                                      **family.config))
        with torch.no_grad():  # sinks and norms start at constants: move every weight off them
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
        model.save_pretrained(root / name)
        models[name] = root / name
    return {"root": root, "store": store, "models": models}


def _train(world, name, run_dir, *extra) -> list[str]:
    return ["train", "--no-progress", "--json", f"model.name_or_path={world['models'][name]}",
            f"data.train={world['store']}", f"run.output_dir={run_dir}", *SETTINGS, *extra]


@pytest.fixture(scope="module")
def launch(world):
    root = world["root"]
    runs = {(n, k): root / f"{n}-{k}" for n in RUNS for k in ("one", "ddp")}
    runs |= {(n, k): root / f"{n}-{k}" for k, names in FSDP2.items() for n in names if n in RUNS}
    run_here(*(_train(world, n, runs[n, "one"]) for n in RUNS))
    run_prefpack(*(_train(world, n, runs[n, "ddp"], "distributed.strategy=ddp") for n in RUNS),
                 *(_train(world, n, runs[n, k], *STRATEGY[k]) for k, names in FSDP2.items() for n in names
                   if n in RUNS),
                 nproc=2, timeout=600)
    return runs


def _steps(run_dir):
    return [(m["step"], m["loss"], m["grad_norm"]) for m in metrics_lines(run_dir)]


@pytest.mark.parametrize("strategy,name", [*(_case("ddp", n) for n in NAMES),
                                           *(_case(k, n) for k, names in FSDP2.items() for n in names)])
def test_two_ranks_equal_one(launch, strategy, name):
    one, two = launch[name, "one"], launch[name, strategy]
    assert len(_steps(one)) == STEPS
    for (s1, l1, g1), (s2, l2, g2) in zip(_steps(one), _steps(two), strict=True):
        assert s1 == s2 and l1 == pytest.approx(l2, abs=5e-6) and g1 == pytest.approx(g2, rel=1e-5), (s1, name)
    w1, w2 = final_weights(one), final_weights(two)
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], atol=ATOL, rtol=0, msg=k)
