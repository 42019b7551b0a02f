"""Where a sampled reply ends: the chat template's end-of-turn token (Llama 3's ``<|eot_id|>``, ChatML's
``<|im_end|>``, Gemma's ``<end_of_turn>``), EOS, and whatever else the user or the model's generation config names.
The end-of-turn token is read off the template itself: the first special token it writes after an assistant
message's content."""

from __future__ import annotations

from collections.abc import Iterable

PROBE_REPLY = "prefpack probe reply"


def end_of_turn_ids(tok) -> tuple[int, ...]:
    """The special token the chat template writes right after an assistant message (none without a template, or
    when the template writes no special token there)."""
    if not tok.chat_template:
        return ()
    messages = [{"role": "user", "content": "prefpack probe"}, {"role": "assistant", "content": PROBE_REPLY}]
    try:
        text = tok.apply_chat_template(messages, tokenize=False)
    except Exception:  # a template that refuses this conversation (it names no end-of-turn then)
        return ()
    at = text.rfind(PROBE_REPLY)
    if at < 0:
        return ()
    special = {int(i) for i in tok.all_special_ids}
    special |= {int(i) for i, t in getattr(tok, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    for tid in tok.backend_tokenizer.encode(text[at + len(PROBE_REPLY):], add_special_tokens=False).ids:
        if tid in special:
            return (int(tid),)
    return ()


def stop_token_ids(tok, *extra: Iterable[int]) -> tuple[int, ...]:
    """End-of-turn, EOS, then the ``extra`` ids (the model's generation config, the user's), each once, in order."""
    ids: list[int] = [*end_of_turn_ids(tok), int(tok.eos_token_id)]
    for more in extra:
        ids.extend(int(i) for i in more)
    return tuple(dict.fromkeys(ids))
