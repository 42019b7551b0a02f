"""One loading seam (prefpack/model/weights.py): the four paths that read weights from a folder (training and
eval through the engine's stages, precompute-ref, sampling, a reward model's scoring) each describe their load in a
``WeightSpec`` with their own defaults and reach ``load_weights``; the 4-bit config and a saved adapter's load are
built there only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from conftest import quiet, tiny_llama, write_jsonl

import prefpack.model as model_pkg
import prefpack.model.weights as seam
from prefpack.model.weights import LOAD_STEPS, FourBit, WeightSpec

REPO = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")


class Reached(Exception):
    """Raised by the recorder instead of loading (a load that needs no real weights to be checked)."""


class Specs(list):
    """The specs that reached the seam; ``stop()``: later ones raise :class:`Reached` instead of loading."""

    halt = False

    def stop(self) -> None:
        self.halt = True


@pytest.fixture
def seen(monkeypatch):
    """Every spec that reaches ``load_weights`` (by either import path); loaded for real unless ``seen.stop``."""
    real = seam.load_weights
    specs = Specs()

    def record(spec: WeightSpec):
        specs.append(spec)
        if specs.halt:
            raise Reached(spec.purpose)
        return real(spec)

    # the package first: its lazy attribute reads the module's, which must still be the real one to be put back
    monkeypatch.setattr(model_pkg, "load_weights", record)
    monkeypatch.setattr(seam, "load_weights", record)
    return specs


@pytest.fixture(scope="module")
def world(tmp_path_factory, toy_tokenizers, one_thread):
    """A tiny Llama, a pair store prepared with its tokenizer, and a one-label reward model."""
    import transformers as tf

    from prefpack.data.prepare import PrepareOptions, prepare

    root = tmp_path_factory.mktemp("seam")
    tok_dir = toy_tokenizers["chatml"]
    rows = [{"prompt": [{"role": "user", "content": c}], "chosen": [{"role": "assistant", "content": "Sure."}],
             "rejected": [{"role": "assistant", "content": "No."}]} for c in ("Hi", "Bake bread?", "A joke", "Why?")]
    prepare(PrepareOptions(inputs=[str(write_jsonl(root / "rows.jsonl", rows))], tokenizer=str(tok_dir),
                           output=str(root / "store"), workers=1), log=quiet)
    model = tiny_llama(tok_dir, root / "model", 0)
    tok = tf.AutoTokenizer.from_pretrained(tok_dir)
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=0)
    tf.LlamaForSequenceClassification(cfg).save_pretrained(root / "rm")
    return {"root": root, "model": str(model), "store": str(root / "store"), "rm": str(root / "rm")}


def test_training_reaches_the_seam_from_the_engine_stages(world, seen, tmp_path):
    """`build` (train and eval): the load stage's policy and the reference stage's copy, each as the stages decided
    (precision, kernel, packing, no 4-bit, a causal LM)."""
    from prefpack.config.io import load_config
    from prefpack.training.setup import build

    cfg = load_config(None, [f"model.name_or_path={world['model']}", f"data.train={world['store']}",
                             f"run.output_dir={tmp_path / 'run'}", "train.global_batch_pairs=4", "run.plot=false",
                             "run.tensorboard=false", "reference.mode=copy"])
    setup = build(cfg, log=quiet)
    engine = setup.engine
    assert [s.purpose for s in seen] == ["train", "reference"]
    for spec in seen:
        assert (spec.path, spec.device, spec.precision, spec.attn, spec.packed, spec.four_bit, spec.reward,
                spec.adapter, spec.dtype) == (world["model"], engine.device, engine.precision, engine.attn,
                                              cfg.data.packing, None, False, None, None)
    # a 4-bit stage's setting travels as the spec's FourBit, on every load the engine makes
    seen.clear()
    seen.stop()
    engine.quantization = FourBit("nf4", double=False)
    with pytest.raises(Reached):
        engine.load_like_policy(world["model"], device=CPU, packed=False, purpose="reference")
    (spec,) = seen
    assert (spec.purpose, spec.four_bit, spec.device, spec.packed, spec.compile_layers) == (
        "reference", FourBit("nf4", double=False), CPU, False, False)


def test_precompute_ref_reaches_the_seam_with_trainings_precision_and_auto_attention(world, seen):
    from prefpack.model import choose_attention
    from prefpack.precision import resolve_precision
    from prefpack.training.precompute import load_reference_model

    load_reference_model(world["model"], "auto", CPU)
    (spec,) = seen
    want = resolve_precision("auto", "auto", CPU)
    assert (spec.purpose, spec.path, spec.device, spec.precision, spec.dtype, spec.packed, spec.reward) == (
        "reference", world["model"], CPU, want, None, True, False)
    assert spec.attn == choose_attention("auto", CPU, want.compute, source=world["model"]).name


def test_sampling_reaches_the_seam_with_its_own_defaults(world, seen, tmp_path):
    """`generate`: sdpa, unpacked, float32 on CPU; `--quantization` as a FourBit in the compute dtype; `--adapter`
    loaded by the seam's adapter step, its refusal still generate's own error and wording."""
    from prefpack.generation.engine import GenerationError
    from prefpack.generation.hf_engine import TransformersEngine

    engine = TransformersEngine.load(world["model"], pad_id=0)
    (spec,) = seen
    assert (spec.purpose, spec.attn, spec.packed, spec.dtype, spec.device, spec.four_bit, spec.adapter) == (
        "sample", "sdpa", False, torch.float32, CPU, None, None)
    assert next(engine.model.parameters()).dtype == torch.float32
    with pytest.raises(GenerationError, match=r"^--adapter '.*': no adapter_config.json there"):
        TransformersEngine.load(world["model"], pad_id=0, adapter=str(tmp_path))
    assert (seen[-1].adapter, seen[-1].adapter_key, seen[-1].adapter_trainable) == (str(tmp_path), "--adapter",
                                                                                     False)
    seen.stop()
    with pytest.raises(Reached):
        TransformersEngine.load(world["model"], pad_id=0, dtype="bfloat16", four_bit="fp4", double_quant=False)
    assert (seen[-1].four_bit, seen[-1].compute_dtype) == (FourBit("fp4", double=False), torch.bfloat16)


def test_reward_model_scoring_reaches_the_seam_as_a_sequence_classifier(world, seen):
    from prefpack.rewards.reward_model import RewardModelScorer

    scorer = RewardModelScorer(world["rm"])
    (spec,) = seen
    assert (spec.purpose, spec.reward, spec.dtype, spec.attn, spec.packed, spec.device) == (
        "score", True, torch.float32, scorer.attention.name, True, CPU)


def test_the_load_steps_run_in_order():
    assert [name for name, _ in LOAD_STEPS] == ["four_bit", "model", "compile", "adapter"]
    with pytest.raises(ValueError, match="purpose"):
        WeightSpec("m", "serve", CPU)


def _calls(attr: str, owner: str | None = None) -> list[str]:
    """``file:function`` of every call of ``attr`` (``owner.attr`` when ``owner``) in the package's source."""
    found = []
    for path in sorted((REPO / "prefpack").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for fn in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]:
            for node in ast.walk(fn):
                if not isinstance(node, ast.Call):
                    continue
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
                held = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
                if name == attr and (owner is None or held == owner):
                    found.append(f"{path.relative_to(REPO / 'prefpack')}:{fn.name}")
    return found


def test_a_four_bit_config_and_an_adapter_load_are_built_in_one_place():
    """`BitsAndBytesConfig(...)` and `PeftModel.from_pretrained(...)` each appear once in the package, in the seam;
    the 4-bit config it builds is the one transformers reads."""
    assert _calls("BitsAndBytesConfig") == ["model/weights.py:four_bit_config"]
    assert _calls("from_pretrained", owner="PeftModel") == ["model/weights.py:load_adapter"]
    q = seam.four_bit_config("nf4", double=True, compute=torch.bfloat16)
    assert (q.load_in_4bit, q.bnb_4bit_quant_type, q.bnb_4bit_use_double_quant, q.bnb_4bit_compute_dtype) == (
        True, "nf4", True, torch.bfloat16)
