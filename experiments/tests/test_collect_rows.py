"""experiments/scripts/collect_rows.py: a row's own archive wins over runs-so-far, a row cut before its
evaluation keeps its layer record, and every copied eval.json gets its report."""

import io
import json
import tarfile
from pathlib import Path

from experiments.scripts.collect_rows import collect
from linearize.eval.results_file import read_results, samples_path, write_results

ROOT = Path(__file__).resolve().parents[2]
EVAL = ROOT / "docs" / "results" / "h100" / "runs" / "lizard-gen" / "eval.json"


def archive(path: Path, files: dict[str, bytes]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_rows_come_back_into_their_folders(tmp_path):
    finished = read_results(EVAL)  # the records inline, as a run of older code brings them back
    finished["provenance"]["partial"] = False
    cut = write_results(read_results(EVAL), tmp_path / "cut" / "eval.json")  # split, as `linearize eval` writes it
    layers = json.dumps({"mse": {"0": 0.1}, "picked": [0]}).encode()
    archive(tmp_path / "rows-a.tgz", {"rows-a/rows.log": b"log", "a/run.json": b"{}",
                                      "a/eval.json": json.dumps(finished).encode(),
                                      "a/model/stage1_layer_errors.json": layers,
                                      "a/model/stage1_layer_errors.png": b"figure"})
    archive(tmp_path / "runs-so-far.tgz", {"runs/a/eval.json": cut.read_bytes(), "runs/a/run.json": b"{}",
                                           "runs/a/eval.samples.jsonl.gz": samples_path(cut).read_bytes(),
                                           "runs/b/model/stage1_layer_errors.json": layers,
                                           "runs/c/model/train_log.jsonl": b"",
                                           "runs/d/eval.json": cut.read_bytes(), "runs/d/run.json": b"{}",
                                           "runs/d/eval.samples.jsonl.gz": samples_path(cut).read_bytes()})
    out = tmp_path / "docs"
    lines = collect(tmp_path, out)
    assert lines[0].startswith("a: evaluated; eval.json, run.json, stage1_layer_errors.json")
    assert lines[1].startswith("b: no evaluation; stage1_layer_errors.json")
    assert lines[2].startswith("d: evaluated; eval.json, eval.samples.jsonl.gz, run.json") and len(lines) == 3
    assert json.loads((out / "a" / "eval.json").read_text())["provenance"]["partial"] is False
    # Written again split, whichever form came back; the records read back whole.
    for row in ("a", "d"):
        assert (out / row / "eval.samples.jsonl.gz").is_file() and (out / row / "eval.json").stat().st_size < 64_000
    assert read_results(out / "a" / "eval.json") == finished and read_results(out / "d" / "eval.json") == read_results(cut)
    assert (out / "a" / "eval.md").exists() and (out / "b" / "stage1_layer_errors.json").read_bytes() == layers
    assert not (out / "c").exists() and not (out / "a" / "stage1_layer_errors.png").exists()  # drawn again where shown
    assert collect(tmp_path, tmp_path / "only", {"b"})[0].startswith("b:") and not (tmp_path / "only" / "a").exists()


def test_an_unevaluated_run_leaves_a_published_evaluated_row_whole(tmp_path):
    """`distill ROW` trains a published row again for the rows that take its stage 1: what comes back has no
    evaluation and must not replace the row's run.json and layer record."""
    finished = read_results(EVAL)
    finished["provenance"]["partial"] = False
    out = tmp_path / "docs"
    (out / "a").mkdir(parents=True)
    (out / "a" / "eval.json").write_text(json.dumps(finished))
    (out / "a" / "run.json").write_text('{"eval_wall_s": 1}')
    archive(tmp_path / "runs-so-far.tgz", {"runs/a/run.json": b"{}",
                                           "runs/a/model/stage1_layer_errors.json": b'{"mse": {}}'})
    [line] = collect(tmp_path, out)
    assert line.startswith("a: not copied")
    assert (out / "a" / "run.json").read_text() == '{"eval_wall_s": 1}'
    assert not (out / "a" / "stage1_layer_errors.json").exists()
