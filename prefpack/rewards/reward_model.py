"""``--reward-model FOLDER``: a Hugging Face sequence-classification model with one label (what reward-model
training exports) scores each prompt + completion sequence at its last token.

For now each sequence is scored on its own, left-padded in batches of similar lengths (:func:`sequence_scores`, the
one function to switch to the packed ``prefpack.model.reward.sequence_rewards``, prompts laid out once, when it lands).
The model reads ``inputs_embeds`` so that its own pooling takes the last position, which left padding makes every
sequence's last token: pooling by ``pad_token_id`` would pick the wrong token when a completion ends with the pad id
(EOS used as padding).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from prefpack.remote_code import check_model_code
from prefpack.rewards.rows import ScoreRow
from prefpack.rewards.scorers import Scorer, ScorerError

DEFAULT_BATCH_TOKENS = 8192  # padded tokens per forward


class RewardModelScorer(Scorer):
    name = "reward_model"

    def __init__(self, folder: str, *, device: str = "auto", dtype: str = "float32", batch_tokens: int =
                 DEFAULT_BATCH_TOKENS, trust_remote_code: bool = False):
        import torch
        from transformers import AutoConfig, AutoModelForSequenceClassification

        self.folder = folder
        check_model_code(folder, allowed=trust_remote_code, what="--reward-model")
        try:
            config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as exc:
            raise ScorerError(f"--reward-model {folder!r}: cannot read its config ({' '.join(str(exc).split())[:200]})"
                              ) from None
        if getattr(config, "num_labels", None) != 1:
            raise ScorerError(f"--reward-model {folder!r}: a reward model has one output (num_labels=1), this one has "
                              f"{getattr(config, 'num_labels', None)}")
        self.device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                                   "cpu" if device == "auto" else device)
        self.dtype = getattr(torch, dtype)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            folder, dtype=self.dtype, trust_remote_code=trust_remote_code).to(self.device).eval()
        if getattr(self.model.config, "pad_token_id", None) is None:
            # it only gates the model's "batch > 1 needs a pad id" check: the last position is read, never the id
            self.model.config.pad_token_id = 0
        self.batch_tokens = batch_tokens

    def identity(self) -> dict:
        h = hashlib.sha256()
        for f in sorted(Path(self.folder).glob("*")):
            if f.is_file() and (f.suffix in (".safetensors", ".bin") or f.name == "config.json"):
                h.update(f.name.encode())
                h.update(hashlib.sha256(f.read_bytes()).digest())
        return {"scorer": self.name, "model": str(self.folder), "sha256": h.hexdigest(),
                "dtype": str(self.dtype).removeprefix("torch.")}

    def score(self, rows: list[ScoreRow]) -> list[list[float]]:
        sequences = [r.prompt_ids + c for r in rows for c in r.completion_ids]
        vocab = self.model.get_input_embeddings().num_embeddings
        for r in rows:
            top = max(max(r.prompt_ids), *(max(c, default=0) for c in r.completion_ids))
            if top >= vocab:
                raise ScorerError(f"--reward-model {self.folder!r}: row {r.row} holds token id {top}, but the model "
                                  f"has {vocab} embeddings: the input's tokenizer is not the model's")
        flat = sequence_scores(self.model, sequences, self.batch_tokens, self.device)
        out, k = [], 0
        for r in rows:
            out.append(flat[k:k + len(r.completion_ids)])
            k += len(r.completion_ids)
        return out


def sequence_scores(model, sequences: list[list[int]], batch_tokens: int, device) -> list[float]:
    """The model's score of each sequence (prompt + completion ids) at its last token, as if run alone: sequences
    sorted by length, left-padded in batches of at most ``batch_tokens`` padded tokens (at least one sequence)."""
    import torch
    from transformers.utils import logging as hf_logging

    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    scores = [0.0] * len(sequences)
    embed = model.get_input_embeddings()
    at = 0
    while at < len(order):
        end = at + 1
        while end < len(order) and len(sequences[order[end]]) * (end + 1 - at) <= batch_tokens:
            end += 1
        batch = [sequences[i] for i in order[at:end]]
        width = max(len(s) for s in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for b, s in enumerate(batch):
            ids[b, width - len(s):] = torch.tensor(s)
            mask[b, width - len(s):] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its note that pad ids go undetected in inputs_embeds: on purpose here
        try:
            with torch.no_grad():
                logits = model(inputs_embeds=embed(ids), attention_mask=mask, position_ids=positions).logits
        finally:
            hf_logging.set_verbosity(verbosity)
        for i, value in zip(order[at:end], logits[:, 0].float().tolist()):
            scores[i] = value
        at = end
    return scores
