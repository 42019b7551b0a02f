"""``--reward-model FOLDER``: a Hugging Face sequence-classification model with one label (what reward-model
training exports) scores each prompt + completion at its completion's last scored token.

Scoring runs prefpack's training forward (``prefpack.model.reward.sequence_rewards``) on prefpack's packed batches:
a row's prompt and its completions are one group (``batching.collate.collate_groups``), planned into micro-batches
of at most ``--batch-tokens`` positions (``batching.plan.plan_groups``), the prompt laid out once for all its
completions when the attention kernel reads prompt groups (packed_sdpa on CPU, varlen on CUDA in half precision;
otherwise each completion is packed after its own copy of the prompt). No padding, no position is computed twice,
and each score equals the model's score of that sequence run alone (the head read at its last token; tested).
A completion whose last tokens are unscored (a store's masked span) is read at its last scored token, as training
reads it. Planning keeps the rows' order and needs no seed, so a resumed run scores each checkpoint's rows in the
same micro-batches as an uninterrupted one: the same bytes.

A model folder that holds its own tokenizer is compared with the input's first (``check_input``): another tokenizer's
ids are never scored as if they were its own; the prompts and completions are re-tokenised from their text
(``retokenise``), said in one line.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from prefpack.remote_code import check_model_code
from prefpack.rewards.rows import ScoreRow
from prefpack.rewards.scorers import Scorer, ScorerError

DEFAULT_BATCH_TOKENS = 8192  # positions per forward (packed: real tokens, each shared prompt counted once)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")  # a folder that holds its tokenizer
ROW_TOKENS = 4096  # at most this many positions per packed row (a micro-batch of --batch-tokens holds several)


class RewardModelScorer(Scorer):
    name = "reward_model"

    def __init__(self, folder: str, *, device: str = "auto", dtype: str = "float32", batch_tokens: int =
                 DEFAULT_BATCH_TOKENS, trust_remote_code: bool = False):
        import torch
        from transformers import AutoConfig

        from prefpack.model.attention.auto import choose_attention
        from prefpack.model.attention.kernels import kernel_of
        from prefpack.model.load import pick_device
        from prefpack.model.weights import WeightSpec, load_weights

        self.folder, self.trust_remote_code = folder, trust_remote_code
        self._own, self._own_hash, self.same, self.retokeniser = None, None, {}, None  # see check_input
        check_model_code(folder, allowed=trust_remote_code, what="--reward-model")
        try:
            config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as exc:
            raise ScorerError(f"--reward-model {folder!r}: cannot read its config ({' '.join(str(exc).split())[:200]})"
                              ) from None
        archs = getattr(config, "architectures", None) or []
        if archs and not any(a.endswith("ForSequenceClassification") for a in archs):  # e.g. the policy itself
            raise ScorerError(f"--reward-model {folder!r} is a {archs[0]}, not a reward model (a one-label "
                              "...ForSequenceClassification); train one from it with train.objective=reward "
                              "(docs/reward-models.md), or score with --reward-fn")
        if getattr(config, "num_labels", None) != 1:
            raise ScorerError(f"--reward-model {folder!r}: a reward model has one output (num_labels=1), this one has "
                              f"{getattr(config, 'num_labels', None)}")
        if batch_tokens < 1:
            raise ScorerError(f"--batch-tokens must be at least 1, not {batch_tokens}")
        self.device = pick_device(device)
        self.dtype = getattr(torch, dtype)
        self.attention = choose_attention("auto", self.device, self.dtype, source=folder,
                                          trust_remote_code=trust_remote_code)  # its describe(): the load line
        self.model = load_weights(WeightSpec(folder, "score", self.device, dtype=self.dtype, attn=self.attention.name,
                                             trust_remote_code=trust_remote_code, reward=True)).eval()
        kernel = kernel_of(self.model)
        self.share_prompts = kernel.runs_prompt_groups(kernel.flattens_rows)
        self.batch_tokens = batch_tokens

    def own_tokenizer(self):
        """The tokenizer the model folder holds (as an exported reward model does), loaded once; None without one."""
        from prefpack.tokenizer import load_tokenizer

        if self._own is None and any((Path(self.folder) / f).is_file() for f in TOKENIZER_FILES):
            self._own = load_tokenizer(self.folder, trust_remote_code=self.trust_remote_code)
        return self._own

    def check_input(self, source, allow_mismatch: bool = False) -> str | None:
        """Compare the model's own tokenizer with the input's (``source``: a ``rows.ScoreInput``), as train and eval
        compare a model's tokenizer with a store's (``tokenizer_matches``): the same (or no tokenizer in the model's
        folder): the input's ids are scored as they are. Another: each prompt + completion is re-tokenised from its
        text with the model's own tokenizer and chat template (``retokenise``); a store or a samples file without its
        texts is a one-line error. ``allow_mismatch`` (``rounds``: ``model.allow_tokenizer_mismatch``): the ids are
        scored as they are all the same. Returns the one line that says so, or None."""
        from prefpack.rewards.retokenise import Retokeniser, tokenizer_label
        from prefpack.tokenizer import tokenizer_hash, tokenizer_matches

        self.retokeniser = None
        own = self.own_tokenizer()
        if own is None:
            return None
        key = (str(source.path), tokenizer_hash(source.tok))
        if key not in self.same:
            recorded = source.meta.get("tokenizer")
            if self._own_hash is None:
                self._own_hash = tokenizer_hash(own)
            self.same[key] = (isinstance(recorded, dict) and bool(recorded.get("hash"))
                              and tokenizer_matches(own, recorded)) or self._own_hash == key[1]
        if self.same[key]:
            return None
        if allow_mismatch:
            return (f"the reward model's tokenizer ({tokenizer_label(own, self.folder)}) differs from the input's "
                    f"({tokenizer_label(source.tok, source.tokenizer_dir)}): its token ids are scored as they are "
                    "(allow_tokenizer_mismatch)")
        retokeniser = Retokeniser(own, self.folder, source)
        note = retokeniser.scan()
        self.retokeniser = retokeniser
        return note

    def identity(self) -> dict:
        h = hashlib.sha256()
        for f in sorted(Path(self.folder).glob("*")):
            if f.is_file() and (f.suffix in (".safetensors", ".bin") or f.name == "config.json"):
                h.update(f.name.encode())
                h.update(hashlib.sha256(f.read_bytes()).digest())
        out = {"scorer": self.name, "model": str(self.folder), "sha256": h.hexdigest(),
               "dtype": str(self.dtype).removeprefix("torch.")}
        if self.retokeniser is not None:  # the input re-tokenised from its text (a resumed run must do so too)
            out["tokens"] = "retokenised"
        return out

    def score(self, rows: list[ScoreRow]) -> list[list[float]]:
        if self.retokeniser is not None:  # the model's own tokenizer is not the input's: its ids from the text
            rows = self.retokeniser.rows(rows)
        vocab = self.model.get_input_embeddings().num_embeddings
        for r in rows:
            top = max(max(r.prompt_ids, default=0), *(max(c, default=0) for c in r.completion_ids))
            if top >= vocab:
                raise ScorerError(f"--reward-model {self.folder!r}: row {r.row} holds token id {top}, but the model "
                                  f"has {vocab} embeddings: the input's tokenizer is not the model's")
        groups = [_group(r) for r in rows]
        flat = packed_scores(self.model, groups, self.batch_tokens, share_prompts=self.share_prompts)
        out, k = [], 0
        for r in rows:
            out.append(flat[k:k + len(r.completion_ids)])
            k += len(r.completion_ids)
        return out


def _group(r: ScoreRow) -> tuple[np.ndarray, list[np.ndarray]]:
    """A row as the collator's group: its prompt and its completions, each carrying its score mask."""
    from prefpack.data.spans import ScoredTokens

    prompt = np.asarray(r.prompt_ids, dtype=np.int64)
    comps = []
    for k, (ids, mask) in enumerate(zip(r.completion_ids, r.scored or [None] * len(r.completion_ids))):
        ids = np.asarray(ids, dtype=np.int64)
        scored = int(len(ids) if mask is None else np.asarray(mask, dtype=bool).sum())
        if len(prompt) == 0 and len(ids) and (mask is None or bool(mask[0])):
            scored -= 1  # with no prompt, the first completion token has no position that reads it
        if scored < 1:
            raise ScorerError(f"--reward-model: row {r.row}, completion {k}: no scored token to read a reward at "
                              "(an empty completion, or one masked whole)")
        comps.append(ids if mask is None else ScoredTokens(ids, mask))
    return prompt, comps


def packed_scores(model, groups: list[tuple[np.ndarray, list[np.ndarray]]], batch_tokens: int, *,
                  share_prompts: bool) -> list[float]:
    """The reward of every completion of ``groups`` (prompt, completions), in order: the groups planned into packed
    micro-batches of at most ``batch_tokens`` positions (a group stays in one row; one longer than that gets a
    micro-batch of its own), each prompt laid out once when ``share_prompts``, run through
    :func:`prefpack.model.reward.sequence_rewards`."""
    import torch

    from prefpack.batching.collate import collate_groups
    from prefpack.batching.plan import plan_groups
    from prefpack.model.reward import sequence_rewards

    if any(getattr(c, "segments", None) is not None for _, cs in groups for c in cs):
        raise ValueError("a reward model reads one reward per completion at its sequence's last token: a completion "
                         "cut into segments (several sequences) has none")
    prompts = np.array([len(p) for p, _ in groups], dtype=np.int64)
    comps = np.array([sum(len(c) for c in cs) for _, cs in groups], dtype=np.int64)
    sizes = np.array([len(cs) for _, cs in groups], dtype=np.int64)
    cost = comps + prompts * (1 if share_prompts else sizes)
    plans = plan_groups(cost, token_budget=batch_tokens, row_budget=min(batch_tokens, ROW_TOKENS), seed=None)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    scores = [0.0] * int(offsets[-1])
    for mb in plans:
        flat = [g for row in mb for g in row]
        local, at = [], 0
        for row in mb:
            local.append(list(range(at, at + len(row))))
            at += len(row)
        batch = collate_groups([groups[g] for g in flat], local, ids=flat, share_prompts=share_prompts)
        with torch.no_grad():
            rewards = sequence_rewards(model, batch).double().cpu().tolist()
        k = 0
        for g in flat:
            n = int(sizes[g])
            scores[int(offsets[g]):int(offsets[g]) + n] = rewards[k:k + n]
            k += n
    return scores
