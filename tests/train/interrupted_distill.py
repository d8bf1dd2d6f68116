"""`linearize distill ARGS...` that is interrupted, as by Ctrl-C on every rank, in its Nth stage-2 training step.

    torchrun --nproc-per-node 2 tests/train/interrupted_distill.py N ARGS...
"""

import sys

from linearize.cli import main
from linearize.train import distillation


def interrupt_at_stage2_step(n: int) -> None:
    real, calls = distillation.stage_loss, {"n": 0}

    def flaky(model, ids, stage):
        calls["n"] += stage == 2 and model.training  # validation runs in eval mode: not counted
        if calls["n"] == n:
            raise KeyboardInterrupt
        return real(model, ids, stage)

    distillation.stage_loss = flaky


if __name__ == "__main__":
    interrupt_at_stage2_step(int(sys.argv[1]))
    sys.exit(main(["distill", *sys.argv[2:]]))
