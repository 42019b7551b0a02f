"""The invariances of tests/invariance_cases.py for DPO on prompt groups: a ranked store (ranked_shared: several
scored completions a prompt, each completion computed once) and a pair store whose pairs repeat prompts, read
grouped by prompt (grouped_shared: each prompt and distinct completion once); and for a reward model (issue 39,
`train.objective=reward`): pairs with margins and unscored spans, prompts laid out once (reward_pairs_shared), and the
ranked store's every pair (reward_ranked_shared). They ride this module's one torchrun launch. The worlds:
tests/invariance_worlds.py."""

from __future__ import annotations

import pytest
from invariance_cases import (  # noqa: F401 - the tests and fixtures run here with this module's `world`
    baseline,
    one_rank,
    precomputed,
    rank_runs,
    test_accumulation_1x8_equals_8x1,
    test_copy_and_precomputed_reference_agree,
    test_packed_equals_padded,
    test_precomputed_reference_refuses_a_sidecar_it_cannot_use,
    test_resume_equals_uninterrupted,
    test_two_ranks_equal_one_rank,
    two_ranks,
)
from invariance_worlds import text_world

KINDS = ["ranked_shared", "grouped_shared", "reward_pairs_shared", "reward_ranked_shared"]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, toy_tokenizers, hh_train):
    return {kind: text_world(kind, tmp_path_factory, toy_tokenizers, hh_train) for kind in KINDS}


@pytest.fixture(scope="module", params=KINDS)
def world(request, worlds):
    return worlds[request.param]
