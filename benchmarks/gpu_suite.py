"""Everything a GPU machine should measure, in one command, within about 10 minutes.

    bash benchmarks/gpu_suite.sh                # on a machine with an NVIDIA GPU
    bash benchmarks/gpu_suite.sh --cpu-smoke    # check the orchestration on CPU, tiny sizes

Steps, each a subprocess with its own time limit (and all within `--budget` seconds):

1. `tests`: the GPU-relevant tests (offload, compiled memory, batching, the solve's contracts,
   tolerances and results, the fused ensemble kernel compiled by Triton against `vmap(solve)`),
   as a JUnit XML summarised to `gpu-tests.{json,md}`.
2. `offload`: `bench_offload.py` on RK4 states of 2**16, 2**18, 2**20 and 2**22 points: device
   memory, host memory and time with and without `offload="host"` (`gpu-offload.*`).
3. `layers`: `bench_layers.py`, per-layer checkpointing: the compiled gradient memory and time
   of a residual stack of 32 .. 512 layers for `lax.scan`, `jax.checkpoint` and
   `checkpointed_layers` (`gpu-layers.*`).
4. `gradients`: `bench_gradients.py --quick`, odeckpt vs diffrax adjoint by adjoint
   (`gpu-gradients.*`).
5. `forward`: `bench_forward.py --quick`, odeckpt vs diffrax (`gpu-forward.*`).
6. `ensemble`: `bench_ensemble_gpu.py`, Lorenz ensembles: `odeckpt.ensemble`'s fused kernel
   beside `vmap(solve)` and diffrax's `vmap(diffeqsolve)`, forward and gradient, float32 then
   float64, at 2**3, 2**10, 2**17 and 2**20 trajectories (`gpu-ensemble.*`). Each size and dtype
   compiles six programs, so the step measures what its time limit allows and records the rest
   as skipped. 2**23 is left out to keep within the limit (run `bench_ensemble_gpu.py` by hand
   for it): the compiled gradients through `vmap` take 18 kB (diffrax) and 49 kB (odeckpt) per
   trajectory on CPU, over 100 GiB at 2**23, where they would be skipped anyway.

It writes `benchmarks/results/gpu-suite.{json,md}` (each step's command, exit status, time and
whether it ran out of time, with the device name) beside each step's own results. Without a GPU
it exits with status 2 and says so; `--cpu-smoke` runs every step on CPU at tiny sizes, writing
into a temporary folder (or `--results DIR`), to check the orchestration.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
NO_GPU_STATUS = 2

GPU_TESTS = [
    "tests/test_offload.py",
    "tests/test_gradient_memory.py",
    "tests/test_memory_report.py",
    "tests/test_batching.py",
    "tests/test_solve.py",
    "tests/test_tolerances.py",
    "tests/test_results.py",
    "tests/test_ensemble.py",
]


NAMES = ["tests", "offload", "layers", "gradients", "forward", "ensemble"]
LIMITS = {
    "tests": 110, "offload": 150, "layers": 45, "gradients": 140, "forward": 40, "ensemble": 85,
}  # fmt: skip
"""Seconds each step may take on a GPU (570 in all, within the 10 minutes the suite promises);
on an H200 the first five steps took about 55 (before `tests/test_ensemble.py` joined them),
30 per state size, 36, 115 (two problems) and 30. The ensemble step stops starting new
measurements 25 s before its limit (start-up and the measurement in flight fit in those)."""


class Step(NamedTuple):
    """One step of the suite: a name, a command (run from the repository root) and its time
    limit in seconds."""

    name: str
    command: list[str]
    timeout: float


def steps(smoke: bool, results: Path) -> list[Step]:
    """The suite's steps, at full size or (`smoke`) at tiny sizes for a CPU check."""
    bench = lambda script, *args: [sys.executable, f"benchmarks/{script}", *args]
    if smoke:
        offload = ["--sizes", "10", "11", "--steps", "20", "--host-checkpoints", "8"]
        layers = ["--depths", "8", "16", "--points", "64"]
        gradients = ["--problems", "lotka_volterra", "--adjoints", "recursive"]
        forward = ["--problems", "lotka_volterra", "--target-seconds", "0.1"]
        forward += ["--compile-repeats", "1"]
        ensemble = ["--quick", "--sizes", "3"]
        tests, limits = ["tests/test_results.py"], dict.fromkeys(NAMES, 240)
    else:
        offload, layers, gradients, forward = ["--sizes", *map(str, range(16, 23, 2))], [], [], []
        ensemble = ["--sizes", "3", "10", "17", "20", "--max-seconds", "15", "--target-seconds",
                    "0.3", "--total-seconds", str(LIMITS["ensemble"] - 25)]  # fmt: skip
        tests, limits = GPU_TESTS, LIMITS
    quick = lambda name: ["--quick", "--name", f"gpu-{name}"]
    commands = {
        "tests": _pytest(tests, results),
        "offload": bench("bench_offload.py", *offload, *quick("offload")),
        "layers": bench("bench_layers.py", *layers, *quick("layers")),
        "gradients": bench("bench_gradients.py", *gradients, *quick("gradients")),
        "forward": bench("bench_forward.py", *forward, *quick("forward")),
        # Its --quick is the CPU smoke run (float64 only, one call): only the smoke passes it.
        "ensemble": bench("bench_ensemble_gpu.py", *ensemble, "--name", "gpu-ensemble"),
    }
    return [Step(name, commands[name], limits[name]) for name in NAMES]


def _pytest(paths: list[str], results: Path) -> list[str]:
    junit = results / "gpu-tests.xml"
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
            "--durations=10", f"--junitxml={junit}", *paths]  # fmt: skip


def device() -> tuple[str, str]:
    """`(backend, device kind)` of JAX's default device, asked in a subprocess, so that this
    process never holds GPU memory the steps need."""
    probe = "import jax; d = jax.devices()[0]; print(jax.default_backend()); print(d.device_kind)"
    completed = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, env=_env()
    )
    if completed.returncode != 0:
        return "none", completed.stderr.strip().splitlines()[-1:][0] if completed.stderr else "?"
    backend, kind = (completed.stdout.strip().splitlines() + ["?", "?"])[:2]
    return backend, kind


def _env(results: Path | None = None) -> dict[str, str]:
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    # Each step allocates what it needs: a step must not find the GPU preallocated.
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env["MPLBACKEND"] = "Agg"
    if results is not None:
        env["ODECKPT_BENCHMARK_RESULTS"] = str(results)
    return env


def run_step(step: Step, deadline: float, results: Path) -> dict:
    """Run `step` with its time limit (cut to what is left before `deadline`); returns its
    record. Its output goes to `results/gpu-<name>.log`."""
    limit = max(1.0, min(step.timeout, deadline - time.monotonic()))
    log = results / f"gpu-{step.name}.log"
    print(f"\n== {step.name} (limit {limit:.0f} s): {' '.join(step.command)}", flush=True)
    start = time.monotonic()
    with open(log, "w") as out:
        try:
            completed = subprocess.run(
                step.command, cwd=ROOT, env=_env(results), stdout=out,
                stderr=subprocess.STDOUT, timeout=limit,
            )  # fmt: skip
            status, timed_out = completed.returncode, False
        except subprocess.TimeoutExpired:
            status, timed_out = None, True
    seconds = time.monotonic() - start
    tail = log.read_text().splitlines()[-15:]
    print("\n".join(tail), flush=True)
    verdict = "ran out of time" if timed_out else f"exit status {status}"
    print(f"-- {step.name}: {verdict} after {seconds:.0f} s", flush=True)
    return {
        "step": step.name,
        "command": " ".join(step.command),
        "exit_status": status,
        "timed_out": timed_out,
        "seconds": round(seconds, 1),
        "limit_seconds": round(limit, 1),
        "log": log.name,
    }


def summarise_tests(results: Path, device_name: str) -> None:
    """`gpu-tests.{json,md}` from the JUnit XML of the tests step (if it got that far)."""
    junit = results / "gpu-tests.xml"
    if not junit.exists():
        return
    cases = []
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        outcome = "passed"
        for kind in ("failure", "error", "skipped"):
            if case.find(kind) is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
        name = f"{case.get('classname')}::{case.get('name')}"
        cases.append({"test": name, "outcome": outcome, "seconds": float(case.get("time", 0))})
    counts = {o: sum(c["outcome"] == o for c in cases) for o in ("passed", "failed", "error",
                                                                  "skipped")}  # fmt: skip
    payload = {"device": device_name, "counts": counts, "tests": cases}
    (results / "gpu-tests.json").write_text(json.dumps(payload, indent=2) + "\n")
    failed = [c["test"] for c in cases if c["outcome"] in ("failed", "error")]
    lines = [f"# GPU tests on {device_name}", "", ", ".join(f"{k}: {v}" for k, v in
                                                            counts.items())]  # fmt: skip
    lines += ["", "Failed:" if failed else "No failures.", *[f"- `{name}`" for name in failed]]
    (results / "gpu-tests.md").write_text("\n".join(lines) + "\n")


def write_summary(records: list[dict], results: Path, device_name: str, total: float) -> None:
    command = " ".join(["bash benchmarks/gpu_suite.sh", *sys.argv[1:]])
    payload = {
        "device": device_name, "command": command, "total_seconds": round(total, 1),
        "steps": records,
    }  # fmt: skip
    (results / "gpu-suite.json").write_text(json.dumps(payload, indent=2) + "\n")
    lines = [
        f"# GPU suite on {device_name}",
        "",
        f"Command: `{command}`; total {total:.0f} s.",
        "",
        "| step | exit status | seconds | limit | results |",
        "|---|---|---|---|---|",
    ]
    for r in records:
        status = "out of time" if r["timed_out"] else str(r["exit_status"])
        lines.append(f"| {r['step']} | {status} | {r['seconds']} | {r['limit_seconds']} | "
                     f"`gpu-{r['step']}.*` |")  # fmt: skip
    (results / "gpu-suite.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cpu-smoke", action="store_true",
        help="run every step on CPU at tiny sizes (checks the orchestration)",
    )  # fmt: skip
    parser.add_argument("--budget", type=float, default=570.0, help="seconds for all steps")
    parser.add_argument("--results", type=Path, help="results folder (default benchmarks/"
                        "results; a temporary folder with --cpu-smoke)")  # fmt: skip
    parser.add_argument("--only", nargs="+", help="run only these steps")
    options = parser.parse_args(argv)
    backend, kind = device()
    if backend != "gpu" and not options.cpu_smoke:
        print(
            f"gpu_suite: no GPU found (JAX's default backend is {backend!r}, device {kind!r}). "
            "This suite measures GPU figures and refuses to run without one. Fix: run it on a "
            'machine with an NVIDIA GPU after `pip install -e ".[dev,cuda]"`; to check the '
            "orchestration on CPU at tiny sizes, pass --cpu-smoke.",
            file=sys.stderr,
        )
        return NO_GPU_STATUS
    results = options.results or (
        Path(tempfile.mkdtemp(prefix="gpu-suite-smoke-")) if options.cpu_smoke else RESULTS
    )
    results.mkdir(parents=True, exist_ok=True)
    device_name = f"{backend}: {kind}"
    print(f"gpu_suite on {device_name}; results in {results}", flush=True)
    start = time.monotonic()
    deadline = start + options.budget
    records = []
    for step in steps(options.cpu_smoke, results):
        if options.only and step.name not in options.only:
            continue
        if time.monotonic() >= deadline:
            print(f"-- {step.name}: skipped, the budget of {options.budget:.0f} s is spent")
            continue
        records.append(run_step(step, deadline, results))
        write_summary(records, results, device_name, time.monotonic() - start)
    summarise_tests(results, device_name)
    total = time.monotonic() - start
    write_summary(records, results, device_name, total)
    failed = [r["step"] for r in records if r["timed_out"] or r["exit_status"] != 0]
    print(f"\ngpu_suite: {len(records)} steps in {total:.0f} s; failed: {failed or 'none'}; "
          f"summary in {results / 'gpu-suite.md'}")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
