"""Host syncs of a training step, counted on the CPU: every place a step waits for the device to hand a value back.

On a GPU each of these stalls the host until the device has finished all queued work (the host can then not queue
the next kernels ahead), so a step of a small model becomes host-bound (issue 43, item 2). They are visible on the
CPU too: a ``TorchDispatchMode`` sees every aten op, and the ops below are the ones whose result the host must read
(``.item()`` / ``float(t)`` / ``bool(t)`` / ``int(t)`` all become ``aten::_local_scalar_dense``; a boolean-mask
index or ``nonzero`` has a data-dependent shape). ``.tolist()``, ``.numpy()`` and ``.cpu()`` do not dispatch on a
CPU tensor, so they are counted by wrapping the methods. On the CPU every tensor is a host tensor, so the tool marks
what would live on the device (the model's parameters and buffers, each ``Batch.to(device)``'s tensors, copied) and
every op's output whose inputs hold a marked tensor; only reads of marked tensors count (a batch built and counted
on the host before it is moved is not a sync). Each event is attributed to its innermost ``prefpack/`` frame.

    PYTHONPATH=. python benchmarks/host_syncs.py [--steps 4] [--loss sigmoid] [--json out.json]

Prints a table (syncs per step by call site) and a JSON line; the counts are the same on a GPU, the time they cost
is not measured here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import traceback
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

REPO = Path(__file__).resolve().parent.parent
PACKAGE = str(REPO / "prefpack") + "/"
MARK = "_prefpack_on_device"  # set on a tensor that would live on the accelerator

# ops whose result the host reads (a scalar, or a shape that depends on the data)
_SCALAR = {"_local_scalar_dense", "item", "is_nonzero", "equal", "allclose"}
_DATA_SHAPE = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive",
               "bincount", "histc"}


def _sync_kind(func, args, kwargs) -> str | None:
    """The kind of host sync an aten call makes, or None."""
    name = func._schema.name.split("::")[-1]
    if name in _SCALAR:
        return f"aten::{name}"
    if name in _DATA_SHAPE:
        return f"aten::{name}"
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):  # x[mask] / x[mask] = v
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()):
            return f"aten::{name}(bool mask)"
    if name == "repeat_interleave" and isinstance(args[0], torch.Tensor) and kwargs.get("output_size") is None:
        if len(args) < 4 or args[3] is None:  # repeats as a tensor, no output_size: the total is read back
            return "aten::repeat_interleave"
    return None


def _site() -> str:
    """The innermost prefpack frame of the current Python stack (file:line function)."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        if frame.filename.startswith(PACKAGE):
            return f"prefpack/{frame.filename[len(PACKAGE):]}:{frame.lineno} {frame.name}"
    return "(outside prefpack)"


class HostSyncs(TorchDispatchMode):
    """Records (phase, kind, site) for every host sync while active; ``phase`` is set by the caller (a step)."""

    def __init__(self):
        super().__init__()
        self.events: Counter = Counter()
        self.phase: str | int = "setup"
        self._patched: list = []

    def _record(self, kind: str) -> None:
        self.events[(self.phase, kind, _site())] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_device = any(getattr(t, MARK, False) for t in inputs)
        if on_device:
            kind = _sync_kind(func, args, kwargs)
            if kind is not None:
                self._record(kind)
        out = func(*args, **kwargs)
        if on_device:  # what is computed from a device tensor stays on the device (in-place ops: their first input)
            for t in [*tree_leaves(out), *(inputs[:1] if func._schema.name.endswith("_") else [])]:
                if isinstance(t, torch.Tensor):
                    setattr(t, MARK, True)
        return out

    def __enter__(self):
        for method in ("tolist", "numpy", "cpu"):
            original = getattr(torch.Tensor, method)

            def wrapped(t, *a, _original=original, _method=method, **k):
                if not getattr(t, MARK, False):
                    return _original(t, *a, **k)
                self._record(f"Tensor.{_method}")
                with torch.utils._python_dispatch._disable_current_modes():  # a host copy, unmarked
                    return _original(t.detach().clone() if _method == "cpu" else t, *a, **k)

            setattr(torch.Tensor, method, wrapped)
            self._patched.append((method, original))
        return super().__enter__()

    def __exit__(self, *exc):
        for method, original in self._patched:
            setattr(torch.Tensor, method, original)
        self._patched.clear()
        return super().__exit__(*exc)

    def per_step(self) -> dict[int, Counter]:
        """{step: Counter((kind, site))} of the device-side syncs (host-side batch building left out)."""
        out: dict[int, Counter] = {}
        for (phase, kind, site), n in self.events.items():
            if isinstance(phase, int):
                out.setdefault(phase, Counter())[(kind, site)] += n
        return out


@contextlib.contextmanager
def counting_steps(counter: HostSyncs):
    """Attributes the counter's events to training steps: the loop's Cadence marks where each step ends."""
    import prefpack.training.loop as loop

    base = loop.Cadence

    class StepMarks(base):
        def begin(self, start, **kw):
            out = super().begin(start, **kw)
            counter.phase = start + 1
            return out

        def after_step(self, done, last):
            super().after_step(done, last)
            counter.phase = done + 1

        def finish(self):
            counter.phase = "end"
            return super().finish()

    from prefpack.batching.collate import Batch
    from prefpack.objectives.kto_batch import KTOBatch

    def marked_to(original):
        def to(self, *a, **k):
            moved = original(self, *a, **k)
            for name, v in vars(moved).items():  # copies, so that the host batch stays unmarked
                if isinstance(v, torch.Tensor) and not getattr(v, MARK, False):
                    v = v.detach().clone()
                    setattr(v, MARK, True)
                    setattr(moved, name, v)
            return moved
        return to

    def marked_wrap(engine, *a, **k):
        for model in (engine.policy, engine.reference.model):
            for t in [*(model.parameters() if model is not None else ()), *(model.buffers() if model else ())]:
                setattr(t, MARK, True)
        return wrap(engine, *a, **k)

    wrap, batch_to, kto_to = loop.wrap_forward, Batch.to, KTOBatch.to
    loop.Cadence, loop.wrap_forward, Batch.to, KTOBatch.to = StepMarks, marked_wrap, marked_to(batch_to), marked_to(kto_to)
    try:
        with counter:
            yield counter
    finally:
        loop.Cadence, loop.wrap_forward, Batch.to, KTOBatch.to = base, wrap, batch_to, kto_to


def _world(root: Path, pairs: int) -> dict:
    """A tiny Llama and a pair store prepared from the bundled hh-rlhf sample with a toy tokenizer."""
    import gzip

    from transformers import LlamaConfig, LlamaForCausalLM

    from prefpack.data.prepare import PrepareOptions, prepare
    from prefpack.toy_tokenizer import build_toy_tokenizer

    path = REPO / "examples" / "data" / "hh-rlhf-harmless-base" / "train_2k.jsonl.gz"
    rows = [json.loads(x) for x in gzip.open(path, "rt").read().splitlines()[:200]]
    rows = [r for r in rows if r["chosen"].strip() and r["chosen"] != r["rejected"]][:pairs]
    tok = build_toy_tokenizer([r["prompt"] + r["chosen"] for r in rows], style="llama", vocab_size=400)
    tok.save_pretrained(root / "tok")
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare(PrepareOptions(inputs=[str(root / "train.jsonl")], tokenizer=str(root / "tok"), output=str(root / "store"),
                           max_length=48, min_prompt_keep=0, workers=1), log=lambda m: None)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                 tie_word_embeddings=False)).save_pretrained(root / "policy")
    return {"policy": root / "policy", "train": root / "store"}


def count(root: Path, *, steps: int, extra: list[str] = ()) -> HostSyncs:
    """Runs ``steps`` training steps (4 pairs a step in 2 micro-batches, a reference copy) under the counter."""
    from prefpack.config import load_config
    from prefpack.training import train

    world = _world(root, 16)
    cfg = load_config(None, [f"model.name_or_path={world['policy']}", f"data.train={world['train']}",
                             f"run.output_dir={root / 'run'}", "run.plot=false", "run.tensorboard=false",
                             "train.global_batch_pairs=4", f"train.max_steps={steps}", "run.log_every=2",
                             "train.micro_batch_tokens=128", "data.max_tokens_per_row=128", *extra])
    with counting_steps(HostSyncs()) as counter:
        train(cfg, progress=False, log=lambda m: None)
    return counter


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("overrides", nargs="*", help="config overrides (loss.type=ipo ...)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        counter = count(Path(tmp), steps=args.steps, extra=args.overrides)
    per_step = counter.per_step()
    sites = sorted({key for c in per_step.values() for key in c}, key=lambda k: (k[1], k[0]))
    steps = sorted(per_step)
    print(f"{'kind':<28} {'site':<64} " + " ".join(f"s{s:<3}" for s in steps))
    for key in sites:
        print(f"{key[0]:<28} {key[1][:64]:<64} " + " ".join(f"{per_step[s][key]:<4}" for s in steps))
    totals = {s: sum(per_step[s].values()) for s in steps}
    print(f"{'total':<93} " + " ".join(f"{totals[s]:<4}" for s in steps))
    result = {"steps": steps, "syncs_per_step": totals,
              "sites": [{"kind": k, "site": s, "per_step": [per_step[st][(k, s)] for st in steps]} for k, s in sites]}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
