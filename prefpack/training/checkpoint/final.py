"""The final model of a run: ``save_pretrained`` output (LoRA merged into it) beside its tokenizer, in ``final/``.
LoRA over a 4-bit base (``model.quantization``) is merged into the de-quantised base: a plain checkpoint, never
rounded back to 4 bits. Beside them ``README.md``, the model card (``card``), unless the user put their own there; a
reward model's tokenizer is saved with the chat template its rows were rendered with when it has none of its own.

Apart from the checkpoint formats because it is another artefact: read by transformers rather than by a resume,
written once at the end. It shares their atomic write (a temporary folder renamed when complete) and the report
of a failed write (``files``).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import torch
from torch import nn

from prefpack.distributed import SINGLE, Dist
from prefpack.model import ModelError, TokenizerHandle, is_reward_model
from prefpack.tokenizer import TokenizerError
from prefpack.training.checkpoint.card import is_prefpack_card, reward_chat_template
from prefpack.training.checkpoint.files import _MARGIN, _discard, _disown, _own, _tensor_bytes, _writing


def save_final(run_dir: Path, policy: nn.Module, tokenizer, *, module: nn.Module | None = None,
               ctx: Dist = SINGLE, strategy: str = "ddp", dtype: torch.dtype | None = None,
               image_processor_dir: Path | None = None, keep_policy: bool = False) -> Path | None:
    """`save_pretrained` the trained model (LoRA merged into it) and the tokenizer, atomically, on rank 0; a
    vision-language run also saves its image processor's settings (``image_processor_dir``: an image store's
    ``processor/``), so the folder loads as a whole checkpoint (AutoProcessor, prepare --processor).

    Under FSDP2 the shards are first gathered into one full state dict (every rank takes part). A failed write
    (full disk) removes the temporary folder and raises `CheckpointWriteError` after the other ranks are released.
    ``keep_policy``: the policy trains on after the save (an on-policy round's model): LoRA is merged into a copy and
    the cast to ``dtype`` is made on a copy, never on the policy itself.
    """
    run_dir = Path(run_dir)
    full_state = None
    if ctx.enabled and strategy == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        full_state = {k.removeprefix("model."): v for k, v in sd.items()}
    final = run_dir / "final"
    if not ctx.is_main:
        ctx.barrier()
        return final
    tmp = run_dir / f".final.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        needed = _tensor_bytes(full_state if full_state is not None else policy.state_dict())
        if is_four_bit(policy):
            needed *= 8  # two 4-bit weights a byte, saved de-quantised: at most 4 bytes each
        needed += _MARGIN
        with _writing(tmp, final, needed=needed, run_dir=run_dir):
            tmp.mkdir()
            _own(tmp)
            model = policy
            if hasattr(policy, "merge_and_unload"):  # LoRA; under FSDP2 from the gathered state (rank 0's is sharded)
                policy.save_pretrained(tmp / "adapter", **({} if full_state is None else {"state_dict": full_state}))
                copied = full_state is not None or is_four_bit(policy) or keep_policy
                model = merged_dequantized(policy, full_state) if copied else policy.merge_and_unload()
            elif full_state is not None:
                from transformers import (
                    AutoModelForCausalLM,
                    AutoModelForImageTextToText,
                    AutoModelForSequenceClassification,
                )

                auto = AutoModelForImageTextToText if getattr(policy.config, "vision_config", None) is not None \
                    else AutoModelForSequenceClassification if is_reward_model(policy) else AutoModelForCausalLM
                model = auto.from_config(policy.config)
                model.load_state_dict(full_state)
            if dtype is not None:  # run.save_dtype: cast after merging LoRA, so the merge happens in full precision
                if keep_policy and model is policy and any(p.dtype != dtype for p in model.parameters()):
                    import copy

                    model = copy.deepcopy(model)  # Module.to casts in place: the training policy stays as it is
                model = model.to(dtype)
            model.save_pretrained(tmp)
            tok = None
            try:
                tok = tokenizer.load() if isinstance(tokenizer, TokenizerHandle) else tokenizer
                if is_reward_model(model):  # pipelines and RewardBench format conversations with its template
                    _say(reward_chat_template(tok, run_dir))
                tok.save_pretrained(tmp)
            except (ModelError, TokenizerError) as exc:  # the trained weights matter more than the tokenizer copy
                print(f"warning: {exc}", file=sys.stderr)
            if image_processor_dir is not None:
                for f in Path(image_processor_dir).iterdir():  # preprocessor_config.json (+ processor_config.json)
                    if f.is_file() and not (tmp / f.name).exists():
                        shutil.copy2(f, tmp / f.name)
            _keep_user_files(final, tmp)
            _write_card(run_dir, tmp, model, tok)
            _disown(tmp)
            _discard(final)
            os.replace(tmp, final)
    finally:
        ctx.barrier()  # the other ranks wait here whether or not the write succeeded
    return final


def is_four_bit(model: nn.Module) -> bool:
    """Whether the model holds bitsandbytes 4-bit weights (``model.quantization``); under FSDP2 the sharded weight
    loses its ``quant_state``, which its layer keeps."""
    return any(getattr(m, "quant_state", None) is not None or getattr(getattr(m, "weight", None), "quant_state", None)
               is not None for m in model.modules())


def merged_dequantized(policy: nn.Module, state: dict | None = None) -> nn.Module:
    """A plain float32 copy of a LoRA-wrapped (4-bit) model (on CPU): each 4-bit weight de-quantised, plus its
    adapters' product (``W + scale * B @ A``, what the trained layer computes), the other weights as they are, in a
    model built from the config without its ``quantization_config``, so transformers loads the folder without
    bitsandbytes. Merging into the 4-bit layer (peft's ``merge_and_unload``) would round the sum back to 4 bits.
    ``state``: the policy's full state dict gathered from FSDP2's shards, read instead of its (sharded) tensors; the
    4-bit layers' quantisation states are whole on every rank."""
    import copy

    from bitsandbytes.functional import dequantize_4bit
    from peft.tuners.lora import LoraLayer
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForSequenceClassification,
    )
    from transformers.initialization import no_init_weights

    base = policy.get_base_model()
    config = copy.deepcopy(base.config)
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None \
        else AutoModelForSequenceClassification if is_reward_model(policy) else AutoModelForCausalLM
    with no_init_weights():  # every weight is written below: no random initialisation of a 7B model first
        plain = auto.from_config(config, dtype=torch.float32)
    for key, target in plain.state_dict().items():  # filled in place: one layer's float copy at a time
        path, _, leaf = key.rpartition(".")
        module = base.get_submodule(path)
        layer = module.get_base_layer() if isinstance(module, LoraLayer) else module
        lora = isinstance(module, LoraLayer)
        t = getattr(layer, leaf) if state is None else _state_value(state, path, leaf, lora)
        quant = getattr(t, "quant_state", None) or (getattr(layer, "quant_state", None) if leaf == "weight" else None)
        t = (dequantize_4bit(t.data.contiguous(), quant) if quant is not None else t.detach()).float()
        if lora and leaf == "weight":
            for name in module.active_adapters:
                if name in module.lora_A:
                    t = t + (module.get_delta_weight(name) if state is None else _delta(module, path, name, state)).float()
        with torch.no_grad():
            target.copy_(t)
    return plain


def _state_value(state: dict, path: str, leaf: str, lora: bool) -> torch.Tensor:
    """A plain model's ``path.leaf`` in the LoRA-wrapped model's (gathered) state dict: a layer's base weight, a
    trained copy peft keeps (``modules_to_save``: a reward model's head), or a weight as it is."""
    key = f"base_model.model.{path}{'.base_layer' if lora else ''}.{leaf}".replace("model..", "model.")
    saved = f"base_model.model.{path}.modules_to_save.default.{leaf}"
    return state[saved] if saved in state else state[key]


def _delta(module, path: str, name: str, state: dict) -> torch.Tensor:
    """``scale * B @ A`` of adapter ``name`` from full (gathered) tensors: peft's ``get_delta_weight``."""
    a = state[f"base_model.model.{path}.lora_A.{name}.weight"].float()
    b = state[f"base_model.model.{path}.lora_B.{name}.weight"].float()
    delta = (b @ a) * module.scaling[name]
    return delta.T if getattr(module, "fan_in_fan_out", False) else delta


def _say(line: str | None) -> None:
    if line:
        print(f"note: {line}", file=sys.stderr)


def _write_card(run_dir: Path, tmp: Path, model: nn.Module, tok) -> None:
    """``final/README.md``, the model card (``card``), unless the user's own was kept; a failure is one warning, the
    save goes on."""
    from prefpack.training.checkpoint.card import card_facts, write_cards

    try:
        write_cards(tmp, card_facts(run_dir, model, tok), shown_path=str(run_dir / "final"))
    except Exception as exc:  # the card describes the weights; never lose them over it
        print(f"warning: the model card was not written ({type(exc).__name__}: {exc})", file=sys.stderr)


USER_FILES = ("*.md", "*.txt")  # a model card and notes: save_pretrained never writes them (prefpack's card: below)


def _keep_user_files(final: Path, tmp: Path) -> None:
    """The user's own files in a previous ``final/`` (``README.md``, a model card) carried into the new one; the card
    prefpack wrote (its marker line) is written again instead."""
    if not final.is_dir():
        return
    for pattern in USER_FILES:
        for path in final.glob(pattern):
            if path.is_file() and not (tmp / path.name).exists() and not is_prefpack_card(path):
                shutil.copy2(path, tmp / path.name)
                print(f"kept {path} (not written by prefpack) in the new final model", file=sys.stderr)
