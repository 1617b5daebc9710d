"""`tetrictl bench --sweep`: where does disaggregation win? The sweep's tables and its region map.

A thin shell over `tetri.des.sweep` (the runs and the region map as plain data): it prints one table per
workload and baseline (per GPU budget and load: the baseline's perf/$, TetriInfer's best setup and its
ratio), writes the JSON document (`--output`) and draws the region map (`--plot`): per workload and
baseline, one panel per GPU budget, load across, P:D split down, each cell the best ChunkSize's perf/$
against the baseline's (green where TetriInfer's goodput per dollar is at least the baseline's).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .output import progress, table

if TYPE_CHECKING:
    from tetri.des.sweep import SweepSpec


def floats(text: str, what: str) -> tuple[float, ...]:
    from tetri.des.workloads import WorkloadSpecError

    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise WorkloadSpecError(f"{what}: expected comma-separated numbers, got {text!r}") from None


def ints(text: str, what: str) -> tuple[int, ...]:
    from tetri.des.workloads import WorkloadSpecError

    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise WorkloadSpecError(f"{what}: expected comma-separated whole numbers, got {text!r}") from None


def sweep(spec: SweepSpec, quiet: bool) -> dict[str, Any]:
    from tetri.des.sweep import run_sweep

    with progress("sweep", quiet) as bar:
        return run_sweep(spec, progress=bar)


def write_json(doc: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n", encoding="utf-8")


def print_sweep(doc: dict[str, Any]) -> None:
    s = doc["spec"]
    for workload in s["workloads"]:
        for b in s["baselines"]:
            rows = []
            base = {
                (x["gpus"], x["load"]): x for x in doc["baselines"] if x["workload"] == workload and x["baseline"] == b
            }
            for r in doc["regions"]:
                if r["workload"] != workload or r["baseline"] != b:
                    continue
                bm = base[(r["gpus"], r["load"])]["metrics"]
                best = r["best"]
                pt = next(
                    p
                    for p in doc["points"]
                    if p["workload"] == workload
                    and p["gpus"] == r["gpus"]
                    and p["load"] == r["load"]
                    and (p["prefill"], p["chunk_size"]) == (best["prefill"], best["chunk_size"])
                )
                tm = pt["metrics"]
                rows.append(
                    (
                        r["gpus"],
                        f"{r['load']:g}×",
                        f"{pt['rate_rps']:.3g}",
                        f"{bm['slo_attainment']:.0%}",
                        f"{bm['perf_per_dollar']:,.0f}",
                        f"{best['prefill']}P+{best['decode']}D, chunk {best['chunk_size']}",
                        f"{tm['slo_attainment']:.0%}",
                        f"{tm['perf_per_dollar']:,.0f}",
                        "—" if r["ratio"] is None else f"{r['ratio']:.2f}×",
                        "≥" if r["wins"] else "<",
                    )
                )
            table(
                f"{workload} on {s['profile']}: TetriInfer's best setup vs {b} (SLO {s['slo']['label']}; load "
                f"{s['load_reference']}; goodput = {s['goodput']}; n = {s['n']})",
                [
                    "GPUs",
                    "load",
                    "rate (req/s)",
                    f"{b} within SLO",
                    f"{b} perf/$",
                    "TetriInfer best",
                    "within SLO",
                    "perf/$",
                    "ratio",
                    "",
                ],
                rows,
            )


def write_region_map(doc: dict[str, Any], path: Path) -> None:
    """Rows: (workload, baseline); columns: GPU budgets. Each panel: load across, P:D split down, the best
    ChunkSize's perf/$ ratio TetriInfer / baseline in each cell (log colour scale centred on 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm

    s = doc["spec"]
    rows = [(w, b) for w in s["workloads"] for b in s["baselines"]]
    gpus = s["gpus"]
    loads = s["loads"]
    fig, axes = plt.subplots(
        len(rows), len(gpus), figsize=(1.3 * len(loads) * len(gpus) + 2, 0.45 * max(gpus) * len(rows) + 1.5),
        squeeze=False,
    )  # fmt: skip
    norm = LogNorm(vmin=0.25, vmax=4.0)
    image = None
    for i, (workload, b) in enumerate(rows):
        for j, g in enumerate(gpus):
            ax = axes[i][j]
            grid = np.full((g - 1, len(loads)), np.nan)
            notes: dict[tuple[int, int], str] = {}
            for r in doc["regions"]:
                if (r["workload"], r["baseline"], r["gpus"]) != (workload, b, g):
                    continue
                x = loads.index(r["load"])
                for split, cell in r["by_split"].items():
                    y = int(split) - 1
                    ratio = cell["ratio"]
                    if ratio is None:  # the baseline served nothing within the SLO: TetriInfer some (∞) or none
                        grid[y, x] = 4.0 if cell["wins"] else np.nan
                        notes[(y, x)] = ("∞" if cell["wins"] else "—") + f"\n{cell['chunk_size']}"
                        continue
                    grid[y, x] = min(max(ratio, 0.25), 4.0)
                    notes[(y, x)] = f"{ratio:.2f}\n{cell['chunk_size']}"
            image = ax.imshow(grid, cmap="RdYlGn", norm=norm, aspect="auto", origin="lower")
            for (y, x), text in notes.items():
                ax.text(x, y, text, ha="center", va="center", fontsize=6)
            ax.set_xticks(range(len(loads)), [f"{x:g}×" for x in loads], fontsize=7)
            ax.set_yticks(range(g - 1), [f"{p}P+{g - p}D" for p in range(1, g)], fontsize=7)
            ax.set_title(f"{workload} vs {b}, {g} GPUs", fontsize=8)
            if i == len(rows) - 1:
                ax.set_xlabel("load (× the baseline's burst throughput)", fontsize=7)
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.6, label="perf/$ TetriInfer / baseline (best ChunkSize, in cell)")
    fig.suptitle(
        f"Where TetriInfer's goodput per dollar ≥ the baseline's (green) — {s['profile']}, SLO {s['slo']['label']}",
        fontsize=9,
    )
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
