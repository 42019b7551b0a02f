"""Run under torchrun (2 gloo ranks) by tests/test_sequence_parallel.py: the sequence-parallel attention wrapper
on each rank's token shard, float64. Usage: ``sp_ranks.py OUT_DIR COMMANDS``; each rank saves, per case, its output shard
and the gradients of its q/k/v shards under a fixed cotangent to ``OUT_DIR/attention-RANK.pt``, and the group sum
and its gradient to the same file. The test computes the unsharded answers itself.
Then, in the same process group (one launch), the ``prefpack`` command lines of the JSON file COMMANDS."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from cli_runs import run_commands
from sp_cases import (
    ATTENTION_CASES,
    FORWARD_CASES,
    case_tensors,
    forward_case,
    forward_loss,
    kernel_kwargs,
    tiny_model,
)

from prefpack.distributed import init_from_env
from prefpack.model import sequence_logps
from prefpack.model.attention import packed_sdpa, varlen
from prefpack.model.attention.sequence_parallel import SHARDS, TokenShards, shardable
from prefpack.sequence_parallel import group_sum, make_layout

KERNELS = {"packed_sdpa": packed_sdpa.packed_sdpa_attention, "varlen": varlen.varlen_attention}


def main(out_dir: Path) -> None:
    ctx = init_from_env("cpu")
    sp = make_layout(2, ctx.world, ctx.rank)
    results = {}
    for name, case in ATTENTION_CASES.items():
        q, k, v, pos, cot = case_tensors(case)
        width = q.shape[2] // sp.size
        lo, hi = sp.rank * width, (sp.rank + 1) * width
        qs, ks, vs = (t[:, :, lo:hi].clone().requires_grad_(True) for t in (q, k, v))
        attention = shardable(KERNELS[case["kernel"]])
        row_kwargs = {"position_ids": pos, **kernel_kwargs(case, pos)}
        window = {"sliding_window": case["window"]} if case.get("window") else {}
        out, _ = attention(torch.nn.Module(), qs, ks, vs, None, scaling=case.get("scale"), position_ids=pos[:, lo:hi],
                           **window, **{SHARDS: TokenShards(sp, row_kwargs)})
        (out * cot[:, lo:hi]).sum().backward()
        results[name] = {"out": out.detach(), "dq": qs.grad, "dk": ks.grad, "dv": vs.grad}
    # the group sum: every rank sees the sum; each rank's gradient is the sum's gradient (no factor N)
    x = torch.arange(3, dtype=torch.float64) * (ctx.rank + 1)
    x.requires_grad_(True)
    total = group_sum(x, sp)
    (total * torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)).sum().backward()
    results["group_sum"] = {"out": total.detach(), "grad": x.grad}
    model = tiny_model()
    for name in FORWARD_CASES:
        batch, options = forward_case(name, model)
        model.zero_grad(set_to_none=True)
        out = sequence_logps(model, batch, chunk_size=4, seq=sp, **options)
        forward_loss(out).backward()
        results["forward/" + name] = {"logp_sum": out.logp_sum.detach(), "tail_sum": out.tail_sum.detach(),
                         "wpo_mean": out.wpo_mean, "grads": {k: p.grad.clone() for k, p in model.named_parameters()}}
    torch.save(results, out_dir / f"attention-{ctx.rank}.pt")
    dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    run_commands(sys.argv[2])
