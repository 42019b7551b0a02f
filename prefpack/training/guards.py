"""What stops a run cleanly: SIGTERM (a scheduler's notice before it kills) and steps whose loss or gradient is not
finite.

SIGTERM only sets a flag: the step in flight finishes, then the loop writes a checkpoint and stops. Under torchrun the
flag is summed over ranks once per step, so every rank stops after the same step (a rank that leaves alone would
hang the others in their next collective). A non-finite step is skipped (no optimizer update) rather than written
into the weights; a run that keeps producing them stops, since every later step would be skipped too.
"""

from __future__ import annotations

import math

import torch

from prefpack.distributed import Dist
from prefpack.errors import PrefpackError
from prefpack.stop_signal import StopSignal  # the one stop-signal handler (generate and score use it too)

__all__ = ["MAX_NONFINITE_IN_A_ROW", "NonFiniteError", "NonFiniteSteps", "StopSignal", "TrainingTerminated",
           "check_finite_weights"]

MAX_NONFINITE_IN_A_ROW = 5  # skipped steps in a row that stop a run: one bad batch is skipped, a diverged run stops


class TrainingTerminated(RuntimeError):
    """SIGTERM during training: the run stopped after step ``step`` with a checkpoint of that step."""

    def __init__(self, step: int, signum: int):
        super().__init__(f"terminated by signal {signum} after step {step}")
        self.step, self.signum = step, signum


class NonFiniteError(PrefpackError, ValueError):
    """Steps whose loss or gradient norm is NaN/inf, too many in a row, or final weights that are not finite."""


class NonFiniteSteps:
    """Counts steps skipped for a non-finite loss or gradient norm; stops the run after
    ``MAX_NONFINITE_IN_A_ROW`` in a row."""

    def __init__(self, lr: float, log):
        self.lr, self.log = lr, log
        self.skipped = 0
        self.in_a_row = 0

    def check(self, done: int, loss: float, grad_norm: float, rows) -> bool:
        """True when step ``done`` (counted from 1) may update the weights."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.in_a_row = 0
            return True
        self.skipped += 1
        self.in_a_row += 1
        self.log(f"warning: step {done}: non-finite loss ({loss}) or gradient norm ({grad_norm}); its update is "
                 f"skipped ({self.skipped} skipped so far)")
        if self.in_a_row >= MAX_NONFINITE_IN_A_ROW:
            shown = ", ".join(str(int(r)) for r in list(rows)[:16]) + (", ..." if len(rows) > 16 else "")
            raise NonFiniteError(
                f"stopped at step {done}: {self.in_a_row} steps in a row (steps {done - self.in_a_row + 1}-{done}) "
                f"had a non-finite loss or gradient norm. Likely cause: the learning rate is too high (optim.lr="
                f"{self.lr:g}; try a lower one or optim.max_grad_norm), or the data: step {done} read rows {shown} "
                "of the training store (check them with `prefpack inspect STORE --row N`). No final model was saved.")
        return False


def check_finite_weights(params, ctx: Dist) -> None:
    """Refuses to save weights holding NaN/inf (counted over every rank's shard)."""
    bad = torch.zeros(1, device=ctx.device)
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p
        bad += (~torch.isfinite(local.detach())).sum().to(bad)
    if float(ctx.all_reduce_sum(bad)) > 0:
        raise NonFiniteError(f"the trained weights hold {int(bad.item())} non-finite values; the final model is "
                             "not saved (lower optim.lr, or set optim.max_grad_norm)")
