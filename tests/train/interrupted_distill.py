"""`linearize distill ARGS...` that is interrupted, as by Ctrl-C on every rank, in its Nth stage-2 training step.

    torchrun --nproc-per-node 2 tests/train/interrupted_distill.py N ARGS...
"""

import sys

from linearize.cli import main
from linearize.train import stage_loop


def interrupting_stage_loss(n: int):
    """`stage_loop.stage_loss` that raises KeyboardInterrupt in the Nth stage-2 training step."""
    real, calls = stage_loop.stage_loss, {"n": 0}

    def flaky(model, ids, stage):
        calls["n"] += stage == 2 and model.training  # validation runs in eval mode: not counted
        if calls["n"] == n:
            raise KeyboardInterrupt
        return real(model, ids, stage)

    return flaky


if __name__ == "__main__":
    stage_loop.stage_loss = interrupting_stage_loss(int(sys.argv[1]))
    sys.exit(main(["distill", *sys.argv[2:]]))
