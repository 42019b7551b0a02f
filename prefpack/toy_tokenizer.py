"""Small byte-level BPE tokenizers built locally, in three real-world conventions.

The model hub is not always reachable (CI, air-gapped clusters), yet prefpack's tests and quickstart need
tokenizers that behave like the real families: Llama-style (adds BOS), GPT-NeoX-style (BOS = EOS, adds
nothing) and ChatML/Qwen-style (no BOS, EOS `<|im_end|>`, a chat template). Byte-level BPE encodes any
text, so round trips are exact.
"""

from __future__ import annotations

from collections.abc import Iterable

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

STYLES = ("llama", "neox", "chatml")


def build_toy_tokenizer(texts: Iterable[str], *, style: str = "llama", vocab_size: int = 1024):
    """Train a byte-level BPE on `texts` and wrap it as a transformers fast tokenizer of `style`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if style not in STYLES:
        raise ValueError(f"unknown tokenizer style {style!r}; choose one of {', '.join(STYLES)}")
    specials = {
        "llama": ["<s>", "</s>", "<pad>"],
        "neox": ["<|endoftext|>", "<|padding|>"],
        "chatml": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    }[style]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if style == "llama":
        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
        )
        kwargs = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    elif style == "neox":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        kwargs = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|padding|>"}
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        kwargs = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)
    if style == "chatml":
        fast.chat_template = CHATML_TEMPLATE
    return fast


# Qwen2-VL's image tokens, and a ChatML template that writes an image part as Qwen2-VL's does (one placeholder
# between the vision markers; prepare --processor expands it to the image's token count).
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
VISION_CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def add_vision_tokens(tok):
    """Give a toy ChatML tokenizer Qwen2-VL's image tokens (as special tokens) and a template that writes image
    parts; returns it."""
    tok.add_tokens(list(VISION_TOKENS), special_tokens=True)
    tok.chat_template = VISION_CHATML_TEMPLATE
    return tok
