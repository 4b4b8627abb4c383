"""Benchmark odeckpt.checkpointing against jax.grad(lax.scan), jax.checkpoint and equinox.

For a 4-dim and a 2**16-dim state and n in {1e3, 1e4}: gradient wall time (median over repeats
after warm-up, always compared within the same process) and compiled temporary memory
(`memory_analysis().temp_size_in_bytes`). Writes JSON and a markdown table under
`benchmarks/results/`.

    python benchmarks/bench_checkpointing.py            # full run
    python benchmarks/bench_checkpointing.py --quick    # n = 1e3 only, fewer repeats
    python benchmarks/bench_checkpointing.py --render   # rewrite the markdown from the JSON
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import time

import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
from jax import lax

from odeckpt.checkpointing import bounded_while_loop, checkpointed_scan, scan_plan

jax.config.update("jax_enable_x64", True)
HERE = os.path.dirname(os.path.abspath(__file__))


def step(y, x):
    """A cheap nonlinear step with neighbour coupling (explicit Euler of a toy PDE)."""
    dy = -(y**3) + jnp.sin(y) + 0.1 * (jnp.roll(y, 1) - y) + x
    return y + 0.01 * dy, None


def methods(n: int, c: int):
    xs = jnp.linspace(0.0, 1.0, n)

    def plain(y0):
        return lax.scan(step, y0, xs)[0]

    def remat(y0):
        return lax.scan(jax.checkpoint(step), y0, xs)[0]

    def eqx_scan(y0):
        return eqxi.scan(step, y0, xs, kind="checkpointed", checkpoints=c)[0]

    def eqx_while(y0):
        body = lambda carry: (carry[0] + 1, step(carry[1], xs[carry[0]])[0])
        cond = lambda carry: carry[0] < n
        init = (jnp.asarray(0), y0)
        return eqxi.while_loop(cond, body, init, max_steps=n, kind="checkpointed", checkpoints=c)[1]

    def ours_scan(y0):
        return checkpointed_scan(step, y0, xs, checkpoints=c)[0]

    def ours_default(y0):
        return checkpointed_scan(step, y0, xs)[0]

    def ours_while(y0):
        body = lambda carry: (carry[0] + 1, step(carry[1], xs[carry[0]])[0])
        cond = lambda carry: carry[0] < n
        init = (jnp.asarray(0), y0)
        return bounded_while_loop(cond, body, init, max_steps=n, checkpoints=c)[1]

    return {
        "jax.grad(lax.scan)": plain,
        "lax.scan + jax.checkpoint": remat,
        "eqxi.scan checkpointed": eqx_scan,
        "eqxi.while_loop checkpointed": eqx_while,
        "odeckpt checkpointed_scan": ours_scan,
        "odeckpt bounded_while_loop": ours_while,
        "odeckpt checkpointed_scan (default)": ours_default,
    }


def measure(fn, y0, repeats: int, run: bool):
    grad = jax.jit(jax.grad(lambda y: jnp.sum(fn(y) ** 2)))
    t0 = time.perf_counter()
    compiled = grad.lower(y0).compile()
    compile_s = time.perf_counter() - t0
    temp = compiled.memory_analysis().temp_size_in_bytes
    if not run:
        return {"compile_s": compile_s, "temp_bytes": temp, "time_s": None}
    jax.block_until_ready(compiled(y0))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(y0))
        times.append(time.perf_counter() - t0)
    return {"compile_s": compile_s, "temp_bytes": temp, "time_s": statistics.median(times)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--checkpoints", type=int, default=10)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "checkpointing"))
    parser.add_argument("--render", action="store_true")
    args = parser.parse_args()
    if args.render:
        with open(args.out + ".json") as f:
            saved = json.load(f)
        with open(args.out + ".md", "w") as f:
            f.write(markdown(saved["meta"], saved["rows"]))
        return
    sizes = [1000] if args.quick else [1000, 10000]
    rows = []
    for dim in (4, 2**16):
        for n in sizes:
            y0 = jnp.linspace(0.1, 1.0, dim)
            repeats = 5 if dim == 4 else (3 if n <= 1000 else 1)
            ms = methods(n, args.checkpoints)
            plan = scan_plan(step, y0, jnp.linspace(0.0, 1.0, n))
            for name, fn in ms.items():
                # jax.grad(lax.scan) at 2**16 x 1e4 stores ~5 GB of residuals: compile only.
                run = not (name.startswith("jax.grad") and dim * n * 8 * 4 > 2 * 2**30)
                r = measure(fn, y0, repeats, run)
                r.update(dim=dim, n=n, method=name, checkpoints=args.checkpoints)
                if name.endswith("(default)"):
                    r["plan"] = str(plan)
                rows.append(r)
                print(json.dumps(r), flush=True)
    meta = {
        "device": str(jax.devices()[0]),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "equinox": eqx.__version__,
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE
        ).stdout.strip(),
        "command": "python benchmarks/bench_checkpointing.py" + (" --quick" if args.quick else ""),
    }
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(meta, rows))
    print(markdown(meta, rows))


def markdown(meta, rows) -> str:
    lines = [
        "# Checkpointing benchmark",
        "",
        f"Device `{meta['device']}` ({meta['cpu_count']} CPUs, {meta['platform']}), jax "
        f"{meta['jax']}, equinox {meta['equinox']}, commit `{meta['commit']}`. "
        f"Command: `{meta['command']}`. Gradient of `sum(y_n**2)`, float64, equal `c` = "
        f"{rows[0]['checkpoints']} for the checkpointed methods. Time: median wall seconds; "
        "memory: compiled temporary KiB; ratios are time and memory over the peer.",
        "",
        "| dim | n | method | time (s) | time / jax.grad(lax.scan) | time / equinox "
        "| temp KiB | memory / equinox | compile (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        same = [q for q in rows if q["dim"] == r["dim"] and q["n"] == r["n"]]
        base = next(q for q in same if q["method"].startswith("jax.grad"))
        peer_name = (
            "eqxi.while_loop checkpointed" if "while" in r["method"] else "eqxi.scan checkpointed"
        )
        peer = next(q for q in same if q["method"] == peer_name)
        t = r["time_s"]
        ratio = lambda q, t=t: f"{t / q['time_s']:.2f}" if t and q["time_s"] else "-"
        ours = r["method"].startswith("odeckpt")
        mem = f"{r['temp_bytes'] / peer['temp_bytes']:.2f}" if ours else "-"
        lines.append(
            f"| {r['dim']} | {r['n']} | {r['method']} | {t if t is None else f'{t:.4f}'} | "
            f"{ratio(base)} | {ratio(peer) if ours else '-'} | "
            f"{r['temp_bytes'] / 2**10:.1f} | {mem} | {r['compile_s']:.2f} |"
        )
    plans = [r for r in rows if "plan" in r]
    lines += [
        "",
        "Default plans: " + "; ".join(f"dim {r['dim']}, n {r['n']}: {r['plan']}" for r in plans),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
