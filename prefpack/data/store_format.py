"""What a prefpack store folder holds: its format name and version, the index columns of each kind, the flag
bits, the token dtype, and the names prefpack writes there; and ``StoreError``.

A store is one folder:
- `tokens.bin`: every example's tokens back to back (prompt once, then chosen and rejected; or prompt
  then completion), uint16 when the vocabulary fits, else uint32.
- `index.bin`: int64 rows, one per example, columns named in meta (`offset`, `prompt_len`, then
  `chosen_len`, `rejected_len` for pairs or `completion_len`, `label` for unpaired data, then `flags`,
  `source_file`, `source_row`). A ranked store (several scored completions per prompt) has one row per
  *completion*: `offset` is where the completion starts, the group's prompt (stored once) sits right before its
  first completion, `score` is the float64 score's bit pattern and `group` numbers the prompts 0, 1, 2, ...
- `meta.json`: format version, layout, tokenizer identity, counts, drops by reason, sources, arguments.
- `spans.bin` (version 2, only when some completion token is not scored): int64 rows ``[start, end)`` of absolute
  positions in tokens.bin that get no loss, sorted, apart, each inside one completion; `num_spans` in meta.json
  counts them (``prefpack.data.spans``).
- `images.bin`, `image_index.bin` (version 3, only with images: `prepare --processor`): every image's encoded bytes
  (as read: PNG, JPEG...; no pixels) back to back, and int64 rows of ``IMAGE_COLUMNS``, one per image in store
  order (an example's images consecutive, in prompt order); `num_images` and `processor` (settings and hash) in
  meta.json; `processor/` a copy of the image processor's settings. A store without images is written as version 2.
- `margins.bin` (version 4, pair stores only, only when some row gave a `margin` field): float64, one per pair in
  index order, how much the chosen reward must beat the rejected one by in a reward model's Bradley-Terry loss
  (TRL's `margin` column); 0.0 for a row without one; `num_margins` in meta.json counts the rows that gave one.
  A store with margins is written as version 4 (with or without images), so an older prefpack refuses it rather
  than train without its margins; one without is written as before.
- `segments.bin` (version 5, only when some completion is cut into segments): int64 absolute positions in
  tokens.bin where a later segment of a completion starts, sorted, each strictly inside one completion; `num_segments`
  in meta.json counts them. Each segment is computed as its own sequence ``prompt + segment`` (attending its prompt
  and itself, not the completion's other segments) whose sums add up into the completion's: a chat template that
  rewrites earlier assistant turns once later messages follow has each turn scored in the context it gave the model
  at that turn (``prefpack.data.spans``). A store with segments is written as version 5 (margins may be there too;
  images may not), so an older prefpack refuses it rather than train each completion as one sequence. So is a store
  with a row flagged 4 (``FLAG_OPEN_PROMPT``: its stored prompt stops before the generation prompt, which each of its
  completions starts with, unscored), which an older prefpack would sample from as if it were a whole prompt.
- `logprobs.bin` (ranked stores only, only when some completion was sampled with log-probs recorded: ``prefpack score``
  of a samples file whose ``logprobs`` generate wrote): float32, exactly one value per token of tokens.bin at the same
  position, the sampling policy's raw log-prob of that token (``generation.engine.Sample``: before temperature and
  top-p), for the importance ratios of on-policy objectives; NaN where there is none (every prompt token, and each
  completion sampled without them). `num_logprobs` in meta.json counts the completions that have them. All or nothing
  per store: written when any group has them, the groups before the first such filled with NaN. No format version
  is bumped for it: an older prefpack reads such a store and ignores the file (it would only refuse to --overwrite
  the store, a file it did not write being there). Read with ``Store.sampler_logprobs`` and
  ``Store.completion_logprobs``.
- `tokenizer/`: a copy of the tokenizer, so the store can be decoded and trained on by itself.
- `skipped.jsonl` (only with --skip-invalid): every skipped row with its location and reason.

Apart from ``store`` (writing and reading) so that the format is read in one place; ``store`` imports it.
"""

from __future__ import annotations

import numpy as np

from prefpack.errors import PrefpackError

FORMAT_NAME = "prefpack-store"
FORMAT_VERSION = 2  # what prepare writes for text (version 1: no spans.bin; every completion token scored)
IMAGE_FORMAT_VERSION = 3  # what prepare writes when the store holds images (images.bin, image_index.bin)
MARGIN_FORMAT_VERSION = 4  # what prepare writes when a pair store holds margins.bin (images may be there too)
SEGMENT_FORMAT_VERSION = 5  # what prepare writes when a completion is cut into segments (segments.bin; no images)
# 2: may hold spans.bin, the completion tokens that are not scored (prefpack.data.spans)
READABLE_VERSIONS = (1, 2, 3, 4, 5)
MARGINS_FILE = "margins.bin"
LOGPROBS_FILE = "logprobs.bin"  # ranked stores: float32 per token, the sampler's log-prob (NaN: none); no version bump
LOGPROB_SLACK = 1e-4  # a sampler log-prob a little above 0 (a probability of 1, rounded up) is accepted
IMAGES_FILE = "images.bin"
IMAGE_INDEX_FILE = "image_index.bin"
PROCESSOR_DIR = "processor"
# example: the store row the image belongs to (ranked stores: its group's first row, whose prompt holds it); offset,
# bytes: where its encoded bytes sit in images.bin; width, height: its size in pixels as stored; position: where its
# run of image tokens starts in tokens.bin; tokens: how many
IMAGE_COLUMNS = ("example", "offset", "bytes", "width", "height", "position", "tokens")
PAIR_COLUMNS = ("offset", "prompt_len", "chosen_len", "rejected_len", "flags", "source_file", "source_row")
UNPAIRED_COLUMNS = ("offset", "prompt_len", "completion_len", "label", "flags", "source_file", "source_row")
RANKED_COLUMNS = ("offset", "prompt_len", "completion_len", "score", "group", "flags", "source_file", "source_row")
STORE_KINDS = ("pairs", "unpaired", "ranked")
FLAG_PROMPT_TRUNCATED = 1
FLAG_COMPLETION_TRUNCATED = 2
# a chat row whose stored prompt stops before the generation prompt: a later turn's context (``turn_contexts``) rewrites
# it, so each completion starts with the generation prompt, unscored; a sampler cannot take this prompt as it is
FLAG_OPEN_PROMPT = 4


class StoreError(PrefpackError, ValueError):
    """A store that is missing, incomplete, corrupt or of another format version."""


# What prefpack itself writes in a store folder (besides the sidecars of precompute-ref).
STORE_ENTRIES = {"meta.json", "tokens.bin", "index.bin", "spans.bin", "segments.bin", "skipped.jsonl", "tokenizer",
                 IMAGES_FILE, IMAGE_INDEX_FILE, PROCESSOR_DIR, MARGINS_FILE, LOGPROBS_FILE}


def token_dtype(vocab_size: int) -> np.dtype:
    """The dtype of tokens.bin: uint16 when every token id fits, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def columns_for(kind: str) -> tuple[str, ...]:
    """The index.bin columns of a store kind."""
    return {"pairs": PAIR_COLUMNS, "ranked": RANKED_COLUMNS}.get(kind, UNPAIRED_COLUMNS)


def completion_bounds(kind: str, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every completion's ``[start, end)`` in tokens.bin from index rows of a store kind (offsets as in the rows),
    sorted by start: a pair's chosen then rejected, an unpaired or ranked row's completion."""
    idx = np.asarray(index, dtype=np.int64)
    if kind == "ranked":
        return idx[:, 0], idx[:, 0] + idx[:, 2]
    first = idx[:, 0] + idx[:, 1]
    if kind == "unpaired":
        return first, first + idx[:, 2]
    second = first + idx[:, 2]
    return np.stack([first, second], 1).ravel(), np.stack([second, second + idx[:, 3]], 1).ravel()


# below this share of a store's pairs, repeated prompts are counted but data.group_by_prompt is not advised: it would
# save almost nothing and changes how steps are drawn
GROUPING_ADVICE_SHARE = 0.05


def grouping_pays(repeated_pairs: int, pairs: int) -> bool:
    """Whether enough pairs repeat a prompt for ``data.group_by_prompt`` to be worth advising."""
    return repeated_pairs > 0 and repeated_pairs >= GROUPING_ADVICE_SHARE * max(pairs, 1)
