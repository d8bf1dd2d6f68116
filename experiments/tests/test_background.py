"""experiments/gpu/background.sh wait: a poll brings the finished parts' results back into $OUT even when its
reader stops early (`| head`), which ends the script with SIGPIPE at its next write."""

import subprocess
import tarfile
import time
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


def test_wait_says_whether_the_set_finished_first_and_last(tmp_path):
    """A reply keeps only the output's last 12,000 characters, which the tails' progress bars can fill."""
    bg, out = tmp_path / "bg", tmp_path / "out"
    (bg / "out").mkdir(parents=True)
    out.mkdir()
    (bg / "log").write_text("\r".join(f"stage 2: {i}%|" for i in range(3000)) + "\n")
    for state in ("still running", "finished"):
        if state == "finished":
            (bg / "done").touch()
        said = subprocess.run(["bash", str(SCRIPT), "wait", "0"], check=False, capture_output=True, text=True,
                              env={"BG": str(bg), "OUT": str(out), "PATH": "/usr/bin:/bin"}, timeout=60)
        lines = said.stdout.splitlines()
        assert lines[0] == lines[-1] == state


def test_start_clears_the_last_sets_results(tmp_path):
    """A set started again after a failed start (a missing package) brought the failed set's archives
    back beside its own until those were written over: start begins with an empty results folder."""
    bg = tmp_path / "bg"
    (bg / "out").mkdir(parents=True)
    (bg / "out" / "rows-old.tgz").write_bytes(b"the failed set's")
    (bg / "done").touch()
    started = subprocess.run(["bash", str(SCRIPT), "start", "5", "0: nosuchpart"], cwd=SCRIPT.parents[2], check=False,
                             capture_output=True, text=True, env={"BG": str(bg), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert started.returncode == 0 and started.stdout.startswith("started")
    assert not (bg / "out" / "rows-old.tgz").exists()
    for _ in range(300):  # the detached part ends at once (an unknown part); let it before tmp_path goes
        if (bg / "done").exists():
            break
        time.sleep(0.1)
    assert (bg / "done").exists()


def test_start_names_the_rows_its_parts_run(tmp_path):
    """session.sh names each rows or distill part's rows in $BG/rows as it starts them (here they fail
    at once: no `python` on this PATH), so a poll knows which runs are this set's."""
    bg = tmp_path / "bg"
    started = subprocess.run(["bash", str(SCRIPT), "start", "5", "0: rows nosuchrow, nosuchpart", "0: distill other"],
                             cwd=SCRIPT.parents[2], check=False, capture_output=True, text=True,
                             env={"BG": str(bg), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert started.returncode == 0
    for _ in range(300):
        if (bg / "done").exists():
            break
        time.sleep(0.1)
    assert sorted((bg / "rows").read_text().split()) == ["nosuchrow", "other"]


def test_wait_brings_back_this_sets_rows_so_far_not_those_of_a_set_beside_it(tmp_path):
    """Two sets share the runs folder: the first set's poll once brought the second set's rows back,
    half-run, as if they were its own."""
    bg, out, runs = tmp_path / "bg", tmp_path / "out", tmp_path / "runs"
    (bg / "out").mkdir(parents=True)
    out.mkdir()
    (bg / "rows").write_text("mine\n")
    for row in ("mine", "theirs"):
        (runs / row).mkdir(parents=True)
        (runs / row / "eval.json").write_text("{}")
    (runs / "mine" / "model.safetensors").write_bytes(b"\0" * 3_000_000)  # weights stay on the machine
    subprocess.run(["bash", str(SCRIPT), "wait", "0"], check=True, capture_output=True, text=True, timeout=60,
                   env={"BG": str(bg), "OUT": str(out), "RUNS": str(runs), "PATH": "/usr/bin:/bin"})
    with tarfile.open(out / "runs-so-far.tgz") as archive:
        assert archive.getnames() == ["runs/mine/eval.json"]
