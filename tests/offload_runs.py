"""``cli_runs.py`` for the CPU-offload tests: the same command lines in one launch, and after each run wraps its
forward, rank 0 prints one JSON line with what FSDP2 actually holds: for the policy's and the reference's wrapped
modules, how many FSDP2 parameter groups there are and how many of them offload to the CPU (read from FSDP2's own
state, so a policy that was built but never passed to ``fully_shard`` counts as not offloaded)."""

import json
import sys

from cli_runs import run_commands

import prefpack.training.loop as loop


def _groups(module) -> list[bool]:
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    if module is None:
        return []
    out = []
    for m in module.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group  # torch 2.13: one parameter group per fully_shard call
            if group is not None:
                out.append(isinstance(group.offload_policy, CPUOffloadPolicy))
    return out


def _probing(wrap_forward):
    def probe(engine, forward_options):
        module = wrap_forward(engine, forward_options)
        if engine.parallel.dist.is_main:
            groups = {"policy": _groups(module), "reference": _groups(engine.reference.module)}
            print(json.dumps({"fsdp_groups": {k: [len(v), sum(v)] for k, v in groups.items()}}), flush=True)
        return module
    return probe


if __name__ == "__main__":
    loop.wrap_forward = _probing(loop.wrap_forward)
    run_commands(sys.argv[1])
