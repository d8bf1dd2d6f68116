"""What every benchmark shares: timing, memory, provenance, size parsing and writing DIR/<name>.{json,md,png}."""

from __future__ import annotations

import gc
import platform
import shlex
import statistics
import sys
import time
import traceback
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from linearize.cli_args import compact_json

OOM = torch.cuda.OutOfMemoryError
GIB = 1 << 30
MIB = 1 << 20


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: torch.device, *, warmup: int, iters: int) -> float:
    """Median milliseconds of `fn()` over `iters` calls after `warmup` calls (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def wall_ms(fn, device: torch.device) -> float:
    """Milliseconds of one call of `fn()`, from a synchronised start to a synchronised end."""
    sync(device)
    started = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - started) * 1e3


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> int | None:
    """Peak allocated GPU memory since the last `reset_peak`; None off the GPU (not measured there)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def write_profile(step, device: torch.device, path: Path, rows: int = 40) -> None:
    """One more call of `step` under torch.profiler: the ops that took the most device (or CPU) time, as a table."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60) + "\n")


VIEW_OPS = frozenset({"view", "_unsafe_view", "select", "slice", "unsqueeze", "squeeze", "expand", "transpose", "t",
                      "permute", "as_strided", "alias", "unflatten", "detach", "split", "split_with_sizes", "unfold"})


class OpCount(TorchDispatchMode):
    """Counts the PyTorch ops dispatched while active, views (which launch no kernel) apart: what an
    eager pass pays Python and launch overhead for, on any device."""

    def __init__(self):
        super().__init__()
        self.ops = self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.views += func.__name__.split(".")[0] in VIEW_OPS
        return func(*args, **(kwargs or {}))


def failure(error: BaseException) -> dict:
    """A row's status for a failed measurement, with the error's first line (for an OOM, what it tried to
    allocate and what was free); the traceback goes to stderr so a GPU log shows where it failed."""
    traceback.print_exception(error, file=sys.stderr)
    lines = str(error).strip().splitlines()
    if isinstance(error, OOM):
        return {"status": "oom", "reason": lines[0] if lines else "out of memory"}
    return {"status": "error", "reason": f"{type(error).__name__}: {lines[0] if lines else ''}"}


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def environment(device: torch.device) -> dict:
    cpu = f"CPU ({platform.processor() or platform.machine()})"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu
    return {
        "device": name,
        "device_type": device.type,
        "gpu_memory_bytes": torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "versions": {name: _version(name) for name in ("torch", "transformers", "peft", "triton",
                                                        "flash-linear-attention", "fla-core")},
    }


def switches() -> dict[str, str]:
    """The backend, where it is not the default (`linearize.ops.backend`), as the environment variable
    that reruns it: a run on another backend is another measurement."""
    from ..ops.backend import get_backend

    backend = get_backend()
    return {} if backend == "auto" else {"LINEARIZE_BACKEND": backend}


def new_results(bench: str, subject: str, device: torch.device, settings: dict) -> dict:
    """The provenance every result file starts with; the title names the subject and the device, and the
    command carries the code-path switches that were set, so that it reruns the same measurement."""
    env = environment(device)
    env["switches"] = switches()
    return {
        "bench": bench,
        "title": f"{subject} on {env['device']}",
        "command": " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env["switches"].items()), shlex.join(sys.orig_argv)]),
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "environment": env,
        "settings": settings,
    }


def parse_sizes(text: str) -> list[int]:
    """"1k,4K,1m,512" -> [1024, 4096, 1048576, 512] (k = 1024, m = 1024 * 1024)."""
    sizes = []
    for part in filter(None, (p.strip().lower() for p in text.split(","))):
        scale = {"k": 1 << 10, "m": 1 << 20}.get(part[-1], 1)
        digits = part[:-1] if scale > 1 else part
        if not digits.isdigit() or int(digits) == 0:
            raise ValueError(f"expected sizes such as 1k,4k,1m, got {text!r}")
        sizes.append(int(digits) * scale)
    if not sizes:
        raise ValueError(f"expected at least one size, got {text!r}")
    return sizes


def size_label(n: int) -> str:
    for unit, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def options_note(settings: dict) -> str:
    """" Method options: `k=v`, ...." for the --set options in `settings`, and the layers a hybrid keeps
    softmax (`--softmax-layers`), or ""."""
    options = ", ".join(f"`{k}={v}`" for k, v in settings.get("options", {}).items())
    note = f" Method options: {options}." if options else ""
    for name, variant in (settings.get("variants") or {}).items():
        own = ", ".join(f"`{k}={v}`" for k, v in variant["options"].items()) or "no options of its own"
        note += f" `{name}`: {variant['method']} with {own}."
    if settings.get("softmax_layers"):
        note += f" A hybrid: {settings['softmax_layers']} layers kept softmax, evenly spaced (`--softmax-layers`)."
    return note


# What names a row or point in its line on stderr, in this order; lengths as 2K, 32K.
ROW_NAME = ("model", "op", "mode", "sweep", "B", "H", "L", "D", "batch", "context", "seq_len", "gradient_checkpointing",
            "clients", "prompt_length")
LENGTHS = ("context", "seq_len", "prompt_length")


def record_row(results: dict, entries: str, row: dict, out: Path) -> None:
    """Append `row` to `results[entries]`, rewrite the JSON, and say on stderr how it ended: a long run's
    log shows how far it has come, point by point."""
    results[entries].append(row)
    save_json(results, out)
    name = ", ".join(f"{key} {size_label(row[key]) if key in LENGTHS else row[key]}" for key in ROW_NAME if key in row)
    outcome = row.get("status", "ok") + (f" ({row['reason']})" if row.get("reason") else "")
    if row.get("wall_s") is not None:
        outcome += f", {row['wall_s']:.1f} s"
    print(f"bench {results['bench']}: {len(results[entries])} done; {name}: {outcome}", file=sys.stderr, flush=True)


def save_json(results: dict, out: Path) -> Path:
    """Rewritten after every measurement, so a run cut short still leaves what it measured."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{results['bench']}.json"
    path.write_text(compact_json(results) + "\n", encoding="utf-8")
    return path


def provenance(results: dict) -> list[str]:
    env = results["environment"]
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
    return [
        f"- device: {env['device']}" + (f", CUDA {env['cuda']}" if env["cuda"] else ""),
        f"- versions: {versions}",
        f"- started {results['started_at']}, "
        + (f"wall time {results['wall_time_s']:.0f} s" if "wall_time_s" in results else "**run cut short**"),
        "- command:",
        "",
        "```sh",
        results["command"],
        "```",
    ]


def write_outputs(results: dict, out: Path, tables, plots) -> list[Path]:
    """DIR/<name>.json, the PNGs `plots(results, out)` draws and DIR/<name>.md (provenance, tables, plots)."""
    results["wall_time_s"] = time.time() - datetime.fromisoformat(results["started_at"]).timestamp()
    paths = [save_json(results, out), *plots(results, out)]
    lines = [f"# {results['title']}", "", *provenance(results), "", *tables(results)]
    lines += [f"![{p.stem}]({p.name})" for p in paths[1:]]
    md = out / f"{results['bench']}.md"
    md.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return [*paths, md]


def number(x: float) -> str:
    """Three significant digits, without exponents for the magnitudes benchmarks produce."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def human_bytes(n: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{number(n / scale)} {unit}"
    return f"{n} B"


def cell(row: dict | None, fmt) -> str:
    """A table cell: `fmt(row)` for a measured row, else why there is no number."""
    if row is None:
        return ""
    if row["status"] == "ok":
        return fmt(row)
    return {"oom": "OOM", "skipped": "–", "error": "error"}[row["status"]]
