"""Where the assets live, and how a fetch puts one there whole or not at all.

Every fetch works in a scratch folder inside the cache (`staging`: the same filesystem, so the final
rename is atomic), verifies what it got, and only then renames the result into place, so a final path
that exists is always complete. A scratch folder names its process (`.owner`), so that the next fetch
can sweep those of fetches that were killed outright.
"""

import hashlib
import os
import shutil
import socket
import tempfile
from contextlib import contextmanager
from pathlib import Path


class AssetError(RuntimeError):
    """An asset could not be fetched or failed verification."""


class CacheUnusable(AssetError, ValueError):
    """The cache folder cannot be made or used: bad input from the environment, named by its variable."""


def cache_dir() -> Path:
    """Root of the asset cache: $LINEARIZE_CACHE, else $XDG_CACHE_HOME/linearize, else ~/.cache/linearize."""
    if os.environ.get("LINEARIZE_CACHE"):
        source, root = "LINEARIZE_CACHE", Path(os.environ["LINEARIZE_CACHE"])
    elif os.environ.get("XDG_CACHE_HOME"):
        source, root = "XDG_CACHE_HOME", Path(os.environ["XDG_CACHE_HOME"]) / "linearize"
    else:
        source, root = "HOME", Path.home() / ".cache" / "linearize"
    root = root.expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        reason = e.strerror or str(e)
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(root) else ""
        raise CacheUnusable(f"{source}: cannot make the asset cache {root}: {reason}{where}; set LINEARIZE_CACHE "
                            "to a folder you can write") from None
    return root


_OWNER = ".owner"  # "<host> <pid>" of the process working in a scratch folder


@contextmanager
def staging(name: str):
    """A scratch folder inside the cache (same filesystem, so the final rename is atomic), always removed."""
    sweep_abandoned(name)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=cache_dir()))
    try:
        (tmp / _OWNER).write_text(f"{socket.gethostname()} {os.getpid()}")
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def sweep_abandoned(name: str) -> None:
    """Remove the scratch folders of fetches of `name` that were killed outright (SIGKILL, a lost machine),
    which `staging` could not clean up: hundreds of MB each for the model copies. Only this host's
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


def publish_dir(src: Path, dest: Path) -> None:
    """Rename a finished folder into place."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        src.rename(dest)
    except OSError:
        # Another process finished the same fetch first; its copy is as good as ours.
        if not dest.is_dir():
            raise


def check_sha256(path: Path, expected: str) -> None:
    """Refuse (and delete) a file whose sha256 is not `expected`."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != expected:
        path.unlink()
        raise AssetError(f"{path.name}: sha256 {digest.hexdigest()} does not match the expected {expected}")


def size(path: Path) -> int:
    """Bytes of a file, or of every file under a folder."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
