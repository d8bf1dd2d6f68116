"""experiments/gpu/background.sh wait: a poll brings the finished parts' results back into $OUT even when its
reader stops early (`| head`), which ends the script with SIGPIPE at its next write."""

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "gpu" / "background.sh"


def test_wait_copies_the_results_before_a_closed_pipe_can_stop_it(tmp_path):
    bg, out = tmp_path / "bg", tmp_path / "out"
    (bg / "out").mkdir(parents=True)
    out.mkdir()
    (bg / "out" / "rows-a.tgz").write_bytes(b"results")
    (bg / "done").touch()
    (bg / "log").write_text("".join(f"line {i}\n" for i in range(5000)))  # far more than a pipe holds
    (bg / "chain-1.out").write_text("chain\n")
    done = subprocess.run(f"bash {SCRIPT} wait 1 | head -n 1", shell=True, check=False, capture_output=True, text=True,
                          env={"BG": str(bg), "OUT": str(out), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert done.stdout == "finished\n"
    assert (out / "rows-a.tgz").read_bytes() == b"results"
