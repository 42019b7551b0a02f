"""Load the policy, the reference and the tokenizer; check the store was tokenised by the same tokenizer."""

from __future__ import annotations

import ctypes
import gc
import hashlib
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from prefpack.errors import PrefpackError
from prefpack.model.attention import features
from prefpack.model.attention.kernels import kernel_named, kernel_of
from prefpack.precision import Precision, set_compute_dtype
from prefpack.remote_code import check_model_code
from prefpack.tokenizer import TokenizerError, load_tokenizer, template_sha, tokenizer_hash, tokenizer_matches
from prefpack.tokenizer import hub_reachable as _hub_reachable  # one TCP try, cached (tests replace it here)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class ModelError(PrefpackError, ValueError):
    """A model that cannot be loaded or does not fit the store."""


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelError("train.device is 'cuda' but no CUDA device is available")
    return torch.device(name)


def disable_dropout(model: nn.Module) -> None:
    """Preference losses compare log-probs of two sequences; dropout noise would bias the comparison."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def load_causal_lm(name_or_path: str, *, attn_implementation: str, device: torch.device,
                   precision: Precision | None = None, dtype: torch.dtype | None = None,
                   trust_remote_code: bool = False, packed: bool = True,
                   compile_layers: bool | str = False, quantization_config=None, reward: bool = False) -> nn.Module:
    """Load a model for training or scoring (the package's loaders reach it through ``prefpack.model.weights``'
    ``load_weights``), in ``precision.weights``, to run in ``precision.compute`` (or
    all in ``dtype``). ``reward``: a reward model (``AutoModelForSequenceClassification`` with one label), from a
    causal LM (its new ``score`` head initialised by transformers, as TRL's ``RewardTrainer`` loads it) or from a
    sequence classifier with one label.

    A model without sdpa support falls back to eager attention (with a warning); with ``packed`` (prefpack's
    default batching) a model whose attention crosses packed sequences is refused, naming the padded fallback.
    ``compile_layers`` (True, or ``"auto"``: fall back to eager where compiling fails) compiles each decoder layer
    after that check (``prefpack.model.compile``). ``quantization_config`` (a ``BitsAndBytesConfig``:
    ``prefpack.model.weights.four_bit_config``) loads the linear layers' weights in 4 bits, straight onto ``device``.
    """
    from transformers import AutoModelForCausalLM

    from prefpack.model.checks import packing_leak, sibling_leak
    from prefpack.model.recurrent import install_boundaries, packed_families, uncovered_layers

    kernel = kernel_named(attn_implementation)
    if kernel.register is not None:  # only the kernel this model runs: transformers checks the name it loads
        kernel.register()
    if precision is None:
        precision = Precision(dtype or torch.float32, dtype or torch.float32)
    dtype = precision.weights
    check_model_source(name_or_path)
    check_model_code(name_or_path, allowed=trust_remote_code)  # before transformers reads it: never a prompt
    if device.type == "cuda" and kernel.cudnn_sdp_off:
        torch.backends.cuda.enable_cudnn_sdp(False)  # a new cuDNN plan per packed shape: 14.8 ms CPU per call

    vision = _vision_config(name_or_path, trust_remote_code)  # a vision-language model (issue 27)?
    if vision is not None:
        from prefpack.model.vision import unsupported_message

        message = unsupported_message(vision, f"model {name_or_path!r}")
        if message:
            raise ModelError(message)

    quantized = {} if quantization_config is None else {"quantization_config": quantization_config,
                                                         "device_map": {"": str(device)}}

    if reward and vision is not None:
        raise ModelError(f"model {name_or_path!r} is a vision-language model; reward models train on text models")
    if reward:
        check_reward_source(name_or_path, trust_remote_code)

    def load(attn: str) -> nn.Module:
        if reward:
            from transformers import AutoModelForSequenceClassification
            from transformers.utils import logging as hf_logging

            verbosity = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()  # "newly initialized: score.weight" is what a reward model starts with
            try:
                return AutoModelForSequenceClassification.from_pretrained(
                    name_or_path, dtype=dtype, attn_implementation=attn, trust_remote_code=trust_remote_code,
                    num_labels=1, **quantized)
            finally:
                hf_logging.set_verbosity(verbosity)
        if vision is not None:  # the language model runs the kernel, the vision tower a transformers one
            from transformers import AutoModelForImageTextToText

            from prefpack.model.vision import attention_setting

            return AutoModelForImageTextToText.from_pretrained(name_or_path, dtype=dtype,
                                                               attn_implementation=attention_setting(attn),
                                                               trust_remote_code=trust_remote_code, **quantized)
        return AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, attn_implementation=attn,
                                                    trust_remote_code=trust_remote_code, **quantized)

    try:
        try:
            model = load(attn_implementation)
        except ValueError as exc:
            if kernel.fallback is None or "scaled_dot_product_attention" not in str(exc):
                raise
            model = load(kernel.fallback)
            if features.takes_over_eager(model, kernel):  # gpt-oss: no sdpa because of its sinks, which ours compute
                model.config._attn_implementation = kernel.name
            else:
                warnings.warn(f"model {name_or_path!r} has no sdpa attention; using {kernel.fallback} attention",
                              stacklevel=2)
    except Exception as exc:  # transformers raises OSError/ValueError/HF errors for bad paths and configs
        raise ModelError(f"cannot load model {name_or_path!r}: {exc}") from exc
    features.restore_positions(model)  # Llama-4's layers drop position ids before attention
    why = features.unsupported(model, kernel_of(model), packed=packed)
    if why:
        raise ModelError(f"model {name_or_path!r} {why}")
    disable_dropout(model)
    if quantization_config is not None:
        one_cpu_kernel(model)
        check_quant_state_on_load(model)
    for feature, why in kernel.refuses:
        if _config_value(model, feature):
            raise ModelError(f"model {name_or_path!r} {why}")
    model = model.to(device)
    set_compute_dtype(model, precision)
    install_boundaries(model)  # recurrent layers start each packed sequence from a zero state (model/recurrent)
    if packed:
        leak = packing_leak(model, siblings=False)
        impl = getattr(model.config, "_attn_implementation", "?")
        if leak > PACKING_LEAK_TOLERANCE and uncovered_layers(model):
            raise ModelError(
                f"model {name_or_path!r} ({type(model).__name__}) has recurrent layers prefpack cannot keep within "
                f"packed sequences ({', '.join(uncovered_layers(model))}: their state moved a sequence by {leak:.2g}, "
                f"relative, when the other sequence of its row changed; packed hybrids: {packed_families()}); set "
                "data.packing=false for the padded fallback")
        if leak > PACKING_LEAK_TOLERANCE:
            raise ModelError(
                f"model {name_or_path!r} ({type(model).__name__}, attention {impl!r}) lets packed sequences attend "
                f"to each other (a sequence's hidden states moved by {leak:.2g}, relative, when the other sequence of "
                "its row changed), so prefpack cannot pack it; set data.packing=false for the padded fallback")
        leak = sibling_leak(model)  # 0 unless the kernel reads prompt groups
        if leak > PACKING_LEAK_TOLERANCE:
            raise ModelError(
                f"model {name_or_path!r} ({type(model).__name__}, attention {impl!r}) lets the completions of a "
                f"prompt group attend to each other (a completion's hidden states moved by {leak:.2g}, relative, when "
                "its sibling changed); set data.prefix_sharing=false and model.attn_implementation=sdpa")
    if compile_layers:
        compile_loaded(model, compile_layers, name_or_path)
    return model


def compile_loaded(model: nn.Module, how: bool | str, name_or_path: str) -> None:
    """``model.compile`` on a loaded model: each decoder layer compiled (``how="auto"``: eager where compiling fails,
    and no error when there is no list of layers)."""
    from prefpack.model.compile import compile_decoder_layers

    if not compile_decoder_layers(model, fall_back=how == "auto") and how != "auto":
        raise ModelError(f"model {name_or_path!r}: model.compile found no list of decoder layers to compile; "
                         "set model.compile=false")


def check_reward_source(name_or_path: str, trust_remote_code: bool = False) -> None:
    """A sequence classifier with another number of labels than 1 is not a reward model: refused by name (loading
    it with ``num_labels=1`` would silently replace its head)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except Exception:  # loading the model itself reports a bad path or config
        return
    classifier = any(str(a).endswith("ForSequenceClassification") for a in getattr(config, "architectures", None) or [])
    if classifier and getattr(config, "num_labels", 1) != 1:
        raise ModelError(f"model {name_or_path!r} is a sequence classifier with {config.num_labels} labels; a reward "
                         "model has one (num_labels=1). Start from its causal LM, or from a one-label classifier")


def is_reward_checkpoint(name_or_path: str, trust_remote_code: bool = False) -> bool:
    """Whether a model folder holds a reward model (a ``...ForSequenceClassification`` with one label), so that
    ``prefpack eval --model`` scores it as one."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except Exception:
        return False
    archs = getattr(config, "architectures", None) or []
    return any(str(a).endswith("ForSequenceClassification") for a in archs) and getattr(config, "num_labels", 0) == 1


def one_cpu_kernel(model: nn.Module) -> None:
    """Keep bitsandbytes' 4-bit layers on one kernel on CPU. On a CPU with AVX512-BF16 a layer in eval mode whose
    input needs no gradient (the reference, evaluation) rewrites its weights, once, into another layout for another
    kernel: the reference would then compute differently from the policy on the same weights (and the rewrite
    fails for layers narrower than 32 outputs or a quantisation block)."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def check_quant_state_on_load(model: nn.Module) -> None:
    """Let a checkpoint of a 4-bit model load back into it: its state dict holds each 4-bit layer's quantisation
    state (``weight.absmax``, ...), which ``load_state_dict`` does not take. The base is frozen and quantised the
    same way at every load, so those entries are compared with the layer's own and dropped; a difference (another
    base) is a load error."""
    def take(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        own: dict = {}
        module._save_to_state_dict(own, prefix, keep_vars=False)
        for key in [k for k in state_dict if k.startswith(prefix + "weight.")]:
            value = state_dict.pop(key)
            mine = own.get(key)
            if mine is None or not torch.equal(value.to(mine.device), mine):
                error_msgs.append(f"{key}: the checkpoint's 4-bit base differs from the one loaded now")

    for module in model.modules():
        if getattr(getattr(module, "weight", None), "quant_state", None) is not None:
            module.register_load_state_dict_pre_hook(take)


def _vision_config(name_or_path: str, trust_remote_code: bool):
    """The model's config when it is a vision-language model (it has a ``vision_config``), else None (a causal LM,
    or a config that cannot be read here: loading it then says what is wrong)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except Exception:  # loading the model itself reports a bad path or config
        return None
    return config if getattr(config, "vision_config", None) is not None else None


def _config_value(model: nn.Module, name: str):
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, name, None)


# Where a newcomer gets a local model with no downloads (prefpack.quickstart.SMALL_MODEL_DIR + "/model").
LOCAL_MODEL_HINT = "prefpack quickstart --model-size small writes one to runs/quickstart-small/model"


def check_model_source(name_or_path: str, what: str = "model") -> None:
    """Name a missing model at once, in one line: transformers would retry a folder that does not exist as a hub
    id, for half a minute or more when the hub cannot be reached, and then report a network error. ``what`` is
    where the user gave it (``model.name_or_path``, ``--ref``)."""
    if os.path.isdir(name_or_path):
        return
    looks_local = (os.path.isabs(name_or_path) or name_or_path.startswith((".", "~")) or os.sep * 2 in name_or_path
                   or name_or_path.count("/") > 1 or "\\" in name_or_path)
    if looks_local:
        raise ModelError(f"{what} {name_or_path!r}: no such folder; give a local model folder ({LOCAL_MODEL_HINT})")
    if not _hub_cached(name_or_path) and not _hub_reachable():
        raise ModelError(f"{what} {name_or_path!r}: no such folder here, and the model hub cannot be reached to "
                         "download it as a hub id (offline, or HF_HUB_OFFLINE is set); give a local model folder "
                         f"({LOCAL_MODEL_HINT})")


def _hub_cached(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # not a valid repo id, or an older huggingface_hub
        return False


def source_dtype(name_or_path: str, *, trust_remote_code: bool = False) -> torch.dtype | None:
    """The dtype the model's checkpoint was saved in (its config's ``dtype``), None when it does not say."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except Exception:  # the model itself loaded; a config read twice failing only loses the dtype hint
        return None
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else None


# A model that keeps packed sequences apart gives exactly 0 (the other block's scores are -inf or never
# computed); leaking models measured about 1e-2.
PACKING_LEAK_TOLERANCE = 1e-4


def has_tokenizer_files(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES)


def resolve_tokenizer(model_path: str, store_meta: dict, store_tokenizer: Path, *, tokenizer: str | None = None,
                      allow_mismatch: bool = False, trust_remote_code: bool = False):
    """The tokenizer to train with, refusing one whose content differs from the store's.

    A model folder without tokenizer files is paired with the store's own copy.
    """
    check_model_source(model_path)
    if tokenizer is None and not has_tokenizer_files(model_path) and os.path.isdir(model_path):
        return load_tokenizer(store_tokenizer, trust_remote_code=trust_remote_code)
    source = tokenizer or model_path
    try:
        tok = load_tokenizer(source, trust_remote_code=trust_remote_code)
    except TokenizerError:
        if tokenizer is None:
            return load_tokenizer(store_tokenizer, trust_remote_code=trust_remote_code)
        raise
    want = store_meta["tokenizer"]["hash"]
    if not _same_ids(tok, store_meta["tokenizer"], store_tokenizer, trust_remote_code) and not allow_mismatch:
        raise ModelError(
            f"the tokenizer of {source!r} differs from the one the store was prepared with "
            f"({store_meta['tokenizer']['name']!r}, hash {want[:12]}): token ids would mean different things. "
            "Prepare the data again with this tokenizer, or set model.allow_tokenizer_mismatch=true if you "
            "know the ids agree."
        )
    return tok


def _same_ids(tok, recorded: dict, store_tokenizer: Path, trust_remote_code: bool) -> bool:
    """True when `tok` gives the store's token ids their meaning. A store hashed before version 3 recorded a hash
    that covers the chat template too; when that one differs, the store's own tokenizer copy (saved by prepare) is
    compared instead, by the version-3 hash, if the copy is the one the store recorded."""
    if tokenizer_matches(tok, recorded):
        return True
    if int(recorded.get("hash_version", 1)) >= 3 or not has_tokenizer_files(str(store_tokenizer)):
        return False
    try:
        copy = load_tokenizer(store_tokenizer, trust_remote_code=trust_remote_code)
    except TokenizerError:
        return False
    return tokenizer_matches(copy, recorded) and tokenizer_hash(copy) == tokenizer_hash(tok)


@dataclass(frozen=True)
class TokenizerHandle:
    """Where the run's tokenizer loads from, and its content hash.

    Training reads token ids from the store and never needs the tokenizer, which for a 152k vocabulary holds
    about 200 MiB of process memory. So the trainer checks it, keeps this handle, and loads it again only to
    save it beside the final model, refusing files that changed in between.
    """

    source: str
    content_hash: str
    trust_remote_code: bool = False
    template: str | None = None  # the chat template's sha256: saved with the final model, so a change is refused too

    @classmethod
    def of(cls, tok, *, trust_remote_code: bool = False) -> TokenizerHandle:
        return cls(str(tok.name_or_path), tokenizer_hash(tok), trust_remote_code, template_sha(tok.chat_template))

    def load(self):
        tok = load_tokenizer(self.source, trust_remote_code=self.trust_remote_code)
        if tokenizer_hash(tok) != self.content_hash or template_sha(tok.chat_template) != self.template:
            raise ModelError(f"the tokenizer at {self.source!r} changed while the run was training; the final model "
                             "is saved without it (copy the tokenizer the data was prepared with next to it)")
        return tok


def release_freed_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc only), so they leave the RSS."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): the pages are reused by the process instead
        pass


def check_vocab_fits(model: nn.Module, store_meta: dict, store_path: str) -> None:
    emb = model.get_input_embeddings()
    rows = emb.weight.shape[0] if emb is not None else None
    need = int(store_meta["tokenizer"]["vocab_size"])
    if rows is not None and need > rows:
        raise ModelError(f"store {store_path!r} uses token ids up to {need - 1} but the model's embedding has only "
                         f"{rows} rows; use a model with this tokenizer's vocabulary")


def weights_hash(model: nn.Module) -> str:
    """sha256 of every parameter and buffer (names, shapes, dtypes, bytes) in name order."""
    h = hashlib.sha256()
    state = model.state_dict()
    for name in sorted(state):
        t = state[name].detach()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.contiguous().cpu().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
