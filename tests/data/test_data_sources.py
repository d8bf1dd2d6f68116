import datasets
import pytest
from data_helpers import write_jsonl

from linearize.data import DataError, load_documents, sources
from linearize.data.alpaca import format_example
from linearize.data.sources import data_fingerprint

ALPACA = {"instruction": "Say hi.", "input": "", "output": "Hi!"}


def test_jsonl_text_and_alpaca_records(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "first doc"}, ALPACA, {"text": "   "}, {"text": "last"}])
    assert list(load_documents(path)) == ["first doc", format_example(ALPACA), "last"]


def test_json_list_of_alpaca_records(tmp_path):
    (tmp_path / "alpaca.json").write_text('[{"instruction": "Say hi.", "input": "", "output": "Hi!"}]')
    assert list(load_documents(tmp_path / "alpaca.json")) == [format_example(ALPACA)]


def test_txt_file_is_one_document(tmp_path):
    (tmp_path / "book.txt").write_text("line one\nline two\n")
    assert list(load_documents(str(tmp_path / "book.txt"))) == ["line one\nline two\n"]


def test_folder_is_read_recursively_in_sorted_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_text("b/z")
    (tmp_path / "a.txt").write_text("a")
    write_jsonl(tmp_path / "b" / "c.jsonl", [{"text": "b/c 1"}, {"text": "b/c 2"}])
    (tmp_path / "notes.md").write_text("ignored")
    assert list(load_documents(tmp_path)) == ["a", "b/c 1", "b/c 2", "b/z"]


def test_saved_dataset_with_text_column(tmp_path):
    datasets.Dataset.from_dict({"text": ["one", "two"], "id": [1, 2]}).save_to_disk(tmp_path / "ds")
    assert list(load_documents(tmp_path / "ds")) == ["one", "two"]


def test_saved_dataset_dict_uses_train_split_and_alpaca_columns(tmp_path):
    train = datasets.Dataset.from_dict({k: [v] for k, v in ALPACA.items()})
    test = datasets.Dataset.from_dict({k: ["other"] for k in ALPACA})
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(tmp_path / "dd")
    assert list(load_documents(tmp_path / "dd")) == [format_example(ALPACA)]


def test_missing_path_fails_at_once_naming_it(tmp_path):
    missing = tmp_path / "nowhere" / "data.jsonl"
    with pytest.raises(FileNotFoundError, match="nowhere/data.jsonl"):
        load_documents(missing)
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        load_documents("missing.txt")


def test_unknown_format(tmp_path):
    (tmp_path / "data.csv").write_text("text\nhello\n")
    with pytest.raises(DataError, match="Unsupported data file .*data.csv"):
        load_documents(tmp_path / "data.csv")


def test_record_without_usable_field_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "ok"}, {"question": "?", "answer": "!"}])
    with pytest.raises(DataError, match=r"d.jsonl:2: record has neither a 'text' field .*\['answer', 'question'\]"):
        list(load_documents(path))


def test_invalid_json_line(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(DataError, match="d.jsonl:2: invalid JSON"):
        list(load_documents(tmp_path / "d.jsonl"))


def test_saved_dataset_without_usable_column(tmp_path):
    datasets.Dataset.from_dict({"question": ["?"]}).save_to_disk(tmp_path / "ds")
    with pytest.raises(DataError, match=r"has no usable column.*\['question'\]"):
        load_documents(tmp_path / "ds")


def test_folder_without_data_files(tmp_path):
    (tmp_path / "readme.md").write_text("nothing to train on")
    with pytest.raises(DataError, match="holds no .txt, .json or .jsonl files"):
        load_documents(tmp_path)


def test_hub_name_when_offline_fails_at_once_suggesting_a_local_path(monkeypatch):
    import huggingface_hub

    # Not in HF's offline mode (the Makefile sets it), so the reachability check is what stops us.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(sources, "hub_reachable", lambda: False)
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: pytest.fail("tried the hub"))
    with pytest.raises(DataError, match="'yahma/alpaca-cleaned' is not a local path, and the Hugging Face hub "
                                        "cannot be reached: pass a local"):
        load_documents("yahma/alpaca-cleaned")


def test_hub_failure_suggests_a_local_path(monkeypatch):
    def fails(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'yahma/alpaca-cleaned' on the Hub")

    monkeypatch.setattr(sources, "hub_reachable", lambda: True)
    monkeypatch.setattr(datasets, "load_dataset", fails)
    with pytest.raises(DataError, match="'yahma/alpaca-cleaned' from the Hugging Face hub.*pass a local"):
        load_documents("yahma/alpaca-cleaned")


def test_hub_name_loads_the_train_split(monkeypatch):
    calls = []

    def fake_load_dataset(name, split):
        calls.append((name, split))
        return datasets.Dataset.from_dict({k: [v] for k, v in ALPACA.items()})

    monkeypatch.setattr(sources, "hub_reachable", lambda: True)
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert list(load_documents("yahma/alpaca-cleaned")) == [format_example(ALPACA)]
    assert calls == [("yahma/alpaca-cleaned", "train")]


def test_fingerprint_follows_the_files(tmp_path):
    (tmp_path / "a.txt").write_text("a")
    before = data_fingerprint(tmp_path)
    assert data_fingerprint(tmp_path) == before
    (tmp_path / "a.txt").write_text("a longer text")
    assert data_fingerprint(tmp_path) != before
    assert data_fingerprint("yahma/alpaca-cleaned") != data_fingerprint("tatsu-lab/alpaca")
