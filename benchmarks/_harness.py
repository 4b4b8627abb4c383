"""A small timing harness shared by the benchmark scripts.

- `compare(candidates)` times several jitted callables in one process: compile time (trace +
  lower + XLA compile: the wall time of `jax.jit(fn).lower(*args).compile()`, after
  `jax.clear_caches()`) kept apart from run time (median of repeated calls after warm-up, each
  ended by `jax.block_until_ready`). Candidates are interleaved in rounds so drift in the
  machine's speed hits them alike.
- `environment()` stamps results with the device, library versions, git commit and date.
- `write_results(name, ...)` writes `results/<name>.json` and `results/<name>.md`.

Timings are only meaningful as ratios against a peer measured in the same process (see
DESIGN.md, "Measuring"); ratios are written odeckpt / peer.
"""

import dataclasses
import datetime
import hashlib
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

REPO = Path(__file__).resolve().parent.parent
# `ODECKPT_BENCHMARK_RESULTS` redirects the results (gpu_suite.py --cpu-smoke writes to a temporary
# folder).
RESULTS = Path(
    os.environ.get("ODECKPT_BENCHMARK_RESULTS", Path(__file__).resolve().parent / "results")
)


@dataclasses.dataclass(frozen=True)
class Timing:
    """Compile and run times of one jitted callable, in seconds.

    `compile_s = lower_s + xla_compile_s` is what a user waits for on the first call, less the
    first run; `compile_cpu_s` is the process CPU time of the same (less disturbed by other
    processes on a shared machine, but counts every thread). Each is a median over the compile
    repeats. `run_s` is the median over `repeats` calls after warm-up; `run_min_s` their minimum.
    """

    lower_s: float
    xla_compile_s: float
    compile_s: float
    compile_cpu_s: float
    run_s: float
    run_min_s: float
    repeats: int


def time_compile(fn: Callable, *args) -> tuple[float, float, float]:
    """`(lower_s, xla_compile_s, cpu_s)` of one `jax.jit(fn).lower(*args).compile()`.

    JAX's in-memory caches are cleared first, so it traces, lowers and compiles from scratch
    (the persistent compilation cache is off unless configured).
    """
    jax.clear_caches()
    cpu_start, start = time.process_time(), time.perf_counter()
    lowered = jax.jit(fn).lower(*args)
    middle = time.perf_counter()
    lowered.compile()
    end, cpu_end = time.perf_counter(), time.process_time()
    return middle - start, end - middle, cpu_end - cpu_start


def _call_time(jitted: Callable, args: tuple) -> float:
    start = time.perf_counter()
    jax.block_until_ready(jitted(*args))
    return time.perf_counter() - start


def compare(
    candidates: Mapping[str, tuple[Callable, tuple]],
    *,
    target_s: float = 2.0,
    rounds: int = 3,
    warmup: int = 2,
    compile_repeats: int = 3,
    min_repeats: int = 5,
) -> dict[str, Timing]:
    """Time each `name: (fn, args)` of `candidates` as `jax.jit(fn)(*args)`.

    Compile times come first: `compile_repeats` rounds, each compiling every candidate once (see
    `time_compile`). Run times are then taken in `rounds` rounds; in each round every candidate
    is called repeatedly for about `target_s / rounds` seconds (at least `min_repeats` calls).
    Each figure is the median over all rounds, so slow drift or a burst of load from other
    processes hits all candidates alike.
    """
    compiles: dict[str, list[tuple[float, float, float]]] = {name: [] for name in candidates}
    for _ in range(compile_repeats):
        for name, (fn, args) in candidates.items():
            compiles[name].append(time_compile(fn, *args))
    jitted = {name: jax.jit(fn) for name, (fn, _) in candidates.items()}
    repeats = {}
    for name, (_, args) in candidates.items():
        for _ in range(warmup):
            jax.block_until_ready(jitted[name](*args))
        estimate = max(_call_time(jitted[name], args), 1e-7)
        repeats[name] = max(min_repeats, min(100_000, int(target_s / rounds / estimate)))
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, (_, args) in candidates.items():
            samples[name] += [_call_time(jitted[name], args) for _ in range(repeats[name])]
    timings = {}
    for name in candidates:
        lower, xla, cpu = (
            statistics.median(column) for column in zip(*compiles[name], strict=True)
        )
        timings[name] = Timing(
            lower_s=lower,
            xla_compile_s=xla,
            compile_s=statistics.median([lo + xl for lo, xl, _ in compiles[name]]),
            compile_cpu_s=cpu,
            run_s=statistics.median(samples[name]),
            run_min_s=min(samples[name]),
            repeats=len(samples[name]),
        )
    return timings


def _version(package: str) -> str | None:
    """The installed version of `package`, else its `__version__` if it imports (odeckpt run
    from a checkout that is not installed), else `None`."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        try:
            return getattr(importlib.import_module(package), "__version__", None)
        except ImportError:
            return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git(*command: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *command], cwd=REPO, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def _source_hash() -> str:
    """Hash of the `odeckpt/` sources as they are on disk: identifies the code measured even
    when the working tree is dirty or files are untracked."""
    digest = hashlib.sha256()
    for path in sorted((REPO / "odeckpt").rglob("*.py")):
        digest.update(str(path.relative_to(REPO)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def environment() -> dict[str, Any]:
    """Device, versions, git commit and date of this run."""
    device = jax.devices()[0]
    status = _git("status", "--porcelain", "--untracked-files=normal", "--", "odeckpt")
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": {
            "platform": device.platform,
            "device_kind": device.device_kind,
            "num_devices": jax.device_count(),
            "cpu_model": _cpu_model(),
            "cpu_count": os.cpu_count(),
        },
        "x64_enabled": bool(jax.config.read("jax_enable_x64")),
        "versions": {
            "python": platform.python_version(),
            **{
                name: _version(name)
                for name in ("jax", "jaxlib", "equinox", "diffrax", "numpy", "odeckpt")
            },
        },
        "git": {
            "commit": _git("rev-parse", "--short", "HEAD"),
            "odeckpt_dirty": None if status is None else bool(status),
            "odeckpt_source_sha256": _source_hash(),
        },
        "xla_flags": os.environ.get("XLA_FLAGS"),
    }


def stamp_markdown(env: Mapping[str, Any]) -> str:
    """One paragraph describing `environment()`."""
    device, versions, git = env["device"], env["versions"], env["git"]
    dirty = " with uncommitted changes to odeckpt/" if git["odeckpt_dirty"] else ""
    return (
        f"Device: {device['platform']} / {device['device_kind']} ({device['cpu_model']}, "
        f"{device['cpu_count']} cores). Versions: "
        + ", ".join(f"{name} {version}" for name, version in versions.items())
        + f". Commit {git['commit']}{dirty} (odeckpt sources sha256 "
        f"{git['odeckpt_source_sha256']}). Date {env['date']}."
    )


@dataclasses.dataclass(frozen=True)
class Column:
    """A markdown table column: the record key, its header and a format spec."""

    key: str
    header: str
    fmt: str = ""


TIMING_COLUMNS = [
    Column("odeckpt_run_ms", "run odeckpt (ms)", ".3g"),
    Column("diffrax_run_ms", "run diffrax (ms)", ".3g"),
    Column("run_ratio", "run ratio", ".2f"),
    Column("odeckpt_compile_s", "compile odeckpt (s)", ".2f"),
    Column("diffrax_compile_s", "compile diffrax (s)", ".2f"),
    Column("compile_ratio", "compile ratio", ".2f"),
]
"""Run and compile time of odeckpt and diffrax, and their ratios (`compare`'s keys)."""


def markdown_table(records: Sequence[Mapping[str, Any]], columns: Sequence[Column]) -> str:
    """`records` as a markdown table with one row per record."""

    def cell(value, fmt):
        if value is None:
            return "-"
        return format(value, fmt) if fmt else str(value)

    lines = [
        "| " + " | ".join(c.header for c in columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    for record in records:
        lines.append("| " + " | ".join(cell(record.get(c.key), c.fmt) for c in columns) + " |")
    return "\n".join(lines)


def write_results(
    name: str,
    records: Sequence[Mapping[str, Any]],
    columns: Sequence[Column],
    *,
    title: str,
    command: str,
    env: Mapping[str, Any],
    notes: str = "",
) -> tuple[Path, Path]:
    """Write `results/<name>.json` (all records and the stamp) and `results/<name>.md` (the
    table of `columns`, the command, `notes` and the stamp). **Returns:** both paths."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    json_path, md_path = RESULTS / f"{name}.json", RESULTS / f"{name}.md"
    payload = {"name": name, "command": command, "environment": env, "records": list(records)}
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    parts = [
        f"# {title}",
        f"Command: `{command}`",
        markdown_table(records, columns),
        notes,
        stamp_markdown(env),
    ]
    md_path.write_text("\n\n".join(part for part in parts if part) + "\n")
    return json_path, md_path
