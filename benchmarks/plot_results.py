"""Draw the ratios recorded by `bench_gradients.py` for the benchmarks page.

Reads `benchmarks/results/gradients*.json` and writes `docs/images/benchmarks/gradients.png`:
one bar per (problem, adjoint, setting) for run time, compile time and compiled memory, each as
odeckpt / diffrax (below 1: odeckpt is faster or smaller). Run after the benchmarks:

    python benchmarks/plot_results.py
"""

import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent
OUT = ROOT.parent / "docs" / "images" / "benchmarks"
RATIOS = (("run_ratio", "run time"), ("compile_ratio", "compile time"), ("memory_ratio", "memory"))


def gradient_records() -> list[dict]:
    records = []
    for path in sorted((ROOT / "results").glob("gradients*.json")):
        run = path.stem.removeprefix("gradients").removeprefix("-")  # e.g. "lv-one-core"
        for record in json.loads(path.read_text())["records"]:
            records.append(dict(record, run=run if run != record["problem"] else ""))
    return records


def main() -> None:
    records = gradient_records()
    labels = [
        f"{r['problem']}: {r['adjoint']} ({r['setting']})" + (f" [{r['run']}]" if r["run"] else "")
        for r in records
    ]
    fig, axes = plt.subplots(1, len(RATIOS), figsize=(13, 0.45 * len(records) + 1.5), sharey=True)
    for ax, (key, title) in zip(axes, RATIOS, strict=True):
        values = [r.get(key) or 0.0 for r in records]
        ax.barh(range(len(records)), values, color=["C2" if v <= 1 else "C3" for v in values])
        ax.axvline(1.0, color="k", lw=1)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # log-axis minor labels overlap
        ax.set_title(f"{title}: odeckpt / diffrax")
    axes[0].set_yticks(range(len(records)), labels)
    axes[0].invert_yaxis()
    fig.tight_layout()
    OUT.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT / "gradients.png", dpi=110)
    print(f"wrote {OUT / 'gradients.png'}")


if __name__ == "__main__":
    main()
