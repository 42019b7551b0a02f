"""The policy's token entropy, computed inside the chunked head from the logits it already has (no extra pass, no
gradient), against a float64 full-softmax entropy written out here: per position, and as the per-completion means
the pair objectives log (``entropy/chosen``, ``entropy/rejected``)."""

from __future__ import annotations

import pytest
import torch
from conftest import float64_llama, make_task, prepare_hh_splits

from prefpack.config import load_config
from prefpack.data.store import Store
from prefpack.model import SequenceLogps, SequenceOutput
from prefpack.model.logprobs import completion_logprobs
from prefpack.objectives import PairTask
from prefpack.reference import NoReference

V, H = 37, 6


def full_entropy(z: torch.Tensor) -> torch.Tensor:
    """-sum_v p_v log p_v of softmax(z), row by row, in float64 from the whole row of logits."""
    z = z.double()
    logp = z - torch.logsumexp(z, dim=-1, keepdim=True)
    return -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("transform", [(1.0, None), (0.5, 2.5)])
def test_head_entropy_matches_the_full_softmax(chunk, transform):
    scale, softcap = transform
    g = torch.Generator().manual_seed(0)
    h = torch.randn(10, H, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * 3  # some peaked rows
    b = torch.randn(V, generator=g, dtype=torch.float64)
    t = torch.randint(0, V, (10,), generator=g)
    z = (h @ w.t() + b) * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    logp, ent = completion_logprobs(h, t, w, b, chunk_size=chunk, scale=scale, softcap=softcap, with_entropy=True)
    torch.testing.assert_close(ent, full_entropy(z.detach()), rtol=1e-12, atol=1e-12)
    assert not ent.requires_grad and logp.requires_grad
    # asking for it changes nothing else: the same log-probs and gradients, bitwise, with WPO's output beside it
    plain = completion_logprobs(h, t, w, b, chunk_size=chunk, scale=scale, softcap=softcap)
    assert torch.equal(plain, logp)
    g1, = torch.autograd.grad(logp.sum(), h)
    g2, = torch.autograd.grad(plain.sum(), h)
    assert torch.equal(g1, g2)
    lp3, lss, ent3 = completion_logprobs(h, t, w, b, chunk_size=chunk, scale=scale, softcap=softcap,
                                         with_log_sum_sq=True, with_entropy=True)
    assert torch.equal(ent3, ent) and lss.shape == ent.shape
    # float32 inputs: float32 arithmetic, close to the float64 value
    _, ent32 = completion_logprobs(h.detach().float(), t, w.float(), b.float(), chunk_size=chunk, scale=scale,
                                   softcap=softcap, with_entropy=True)
    torch.testing.assert_close(ent32.double(), full_entropy(z.detach()), rtol=1e-5, atol=1e-5)


def test_pair_objective_logs_mean_completion_entropy(tmp_path, toy_tokenizers, hh_train):
    """A float64 Llama's per-completion mean entropy over its scored tokens, from the pair objective's packed, chunked
    forward (chunks of 3 rows and one chunk of all), equals one plain float64 forward per sequence."""
    store = Store(prepare_hh_splits(tmp_path, toy_tokenizers["llama"], hh_train, {"train": 4})["train"])
    model = float64_llama(toy_tokenizers["llama"], 3)
    task = make_task(PairTask, store, load_config(None, ["loss.terms=[{name: simpo}]"]))
    want = {"chosen": [], "rejected": []}
    for i in range(len(store)):
        p = store.pair(i)
        for side in ("chosen", "rejected"):
            ids = torch.tensor([[int(x) for x in p.prompt] + [int(x) for x in getattr(p, side)]])
            with torch.no_grad():
                logits = model(input_ids=ids, use_cache=False).logits[0, len(p.prompt) - 1:-1]
            want[side].append(float(full_entropy(logits).mean()))
    assert task.forward_options()["entropy"]
    for chunk in (3, 4096):
        policy = SequenceLogps(model, chunk_size=chunk, **task.forward_options())
        got = {"chosen": [], "rejected": []}
        for planned in task.plan(torch.arange(len(store)).numpy(), seed=None):
            batch = task.collate(planned)
            out = task.loss(policy, NoReference(), batch, task.begin_step(policy, NoReference(), [batch]))
            order = batch.pair_indices.tolist()
            for side in got:
                got[side].extend(zip(order, out.metrics[f"entropy/{side}"].tolist()))
        for side in got:
            assert [v for _, v in sorted(got[side])] == pytest.approx(want[side], rel=1e-10, abs=1e-10), (chunk, side)


class _ZeroReference(NoReference):
    """A reference whose log-probs are all 0 (the entropy does not read them)."""

    def sequence_logps(self, batch):
        return SequenceOutput(torch.zeros(batch.num_sequences, dtype=torch.float64), batch.completion_tokens)


def test_kto_logs_entropy_of_desirable_and_undesirable(tmp_path, toy_tokenizers, hh_train):
    """KTO's examples: the mean entropy of the desirable ones as entropy/chosen, of the undesirable as rejected."""
    from invariance_worlds import prepare_splits, unpaired_rows

    from prefpack.objectives import KTOTask

    rows = unpaired_rows(hh_train)["eval"]
    store = Store(prepare_splits(tmp_path, toy_tokenizers["llama"], {"kto": rows}, "--format", "unpaired")["kto"])
    assert len(store) == len(rows)
    model = float64_llama(toy_tokenizers["llama"], 3)
    task = make_task(KTOTask, store, load_config(None, ["loss.terms=[{name: kto}]"]))
    want = {True: [], False: []}
    for i in range(len(store)):
        prompt, completion = task.view.prompt(i), task.view.completion(i)
        ids = torch.tensor([[int(x) for x in prompt] + [int(x) for x in completion]])
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1:-1]
        want[bool(task.view.labels[i])].append(float(full_entropy(logits).mean()))
    policy = SequenceLogps(model, chunk_size=3, **task.forward_options())
    reference = _ZeroReference()
    got = {"entropy/chosen": [], "entropy/rejected": []}
    batches = [task.collate(p) for p in task.plan(torch.arange(len(store)).numpy(), seed=None)]
    state = task.begin_step(policy, reference, batches)
    for batch in batches:
        out = task.loss(policy, reference, batch, state)
        for k in got:
            got[k].extend(out.metrics[k].tolist())
    assert sorted(got["entropy/chosen"]) == pytest.approx(sorted(want[True]), rel=1e-10)
    assert sorted(got["entropy/rejected"]) == pytest.approx(sorted(want[False]), rel=1e-10)
