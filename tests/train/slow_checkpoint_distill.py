"""`linearize distill ARGS...` whose main rank takes its time writing each checkpoint, and whose ranks
fail if they read one while it is being written (a marker file beside it says so).

    torchrun --nproc-per-node 2 tests/train/slow_checkpoint_distill.py ARGS...
"""

import sys
import time

from linearize.cli import main
from linearize.train import checkpoint


def marker(path):
    return path.with_name(path.name + ".writing")


def slow_save(save):
    def wrapped(path, **kwargs):
        if not kwargs["main"]:
            return save(path, **kwargs)
        marker(path).touch()
        time.sleep(2)
        try:
            return save(path, **kwargs)
        finally:
            marker(path).unlink()

    return wrapped


def checked_load(load):
    def wrapped(path):
        if marker(path).exists():
            raise RuntimeError(f"read {path} while the main rank was writing it")
        return load(path)

    return wrapped


if __name__ == "__main__":
    checkpoint.save, checkpoint.load = slow_save(checkpoint.save), checked_load(checkpoint.load)
    sys.exit(main(["distill", *sys.argv[1:]]))
