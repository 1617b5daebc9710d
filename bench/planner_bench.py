"""Planner benchmark: the Sorted-F paper's table, the LP gap, A_min and online studies, and speed.

    python bench/planner_bench.py                 # everything (a few minutes on one core)
    python bench/planner_bench.py --only table    # table | lp | amin | online | speed

Pin it to one core for the speed figures: ``taskset -c 0 python bench/planner_bench.py --only speed``.
Prints rich tables; asserts nothing (the tests assert behaviour).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from tetri.planner.bounds import cheap_bound
from tetri.planner.generate import Mix, generate, with_width
from tetri.planner.improve import default_evals
from tetri.planner.lp import solve_lp
from tetri.planner.metrics import summarize
from tetri.planner.policies import Improve, run_policy
from tetri.planner.solvers import sorted_f_phase1
from tetri.planner.workload import Workload

console = Console(width=140)
MIX = Mix.parse("short:0.8,long:0.2")
MEMORY = 16_384


def timed(fn, *a, **kw):
    t0 = time.perf_counter()
    r = fn(*a, **kw)
    return r, time.perf_counter() - t0


def show(title: str, cols: list[str], rows: list[list[object]]) -> None:
    t = Table(title=title, title_justify="left")
    for i, c in enumerate(cols):
        t.add_column(c, justify="left" if i == 0 else "right")
    for r in rows:
        t.add_row(
            *[
                f"{v:,.3f}" if isinstance(v, float) and v < 100 else f"{v:,.0f}" if isinstance(v, float) else str(v)
                for v in r
            ]
        )
    console.print(t)


def paper_table(seed: int = 1, n: int = 2000) -> None:
    w = generate(MIX, n, seed)
    lb = cheap_bound(w, MEMORY)
    runs = [
        ("fcfs", {}),
        ("mcsf", {}),
        ("mcsf-skip", {}),
        ("size", {}),
        ("area", {}),
        ("sorted-f", {"solver": "swap"}),
        ("sorted-f", {"solver": "swap", "backfill": True}),
        ("sorted-f", {"solver": "quantile"}),
        ("sorted-f", {"solver": "auto"}),  # with the improvement phase's default moves (what `plan solve` runs)
    ]
    res = {}
    rows = []
    for name, kw in runs:
        searched = kw.get("solver") == "auto"
        how = {"improvement": Improve(max_evals=default_evals(w.n))} if searched else {}
        r, dt = timed(run_policy, name, w, MEMORY, **kw, **how)
        m = summarize(w, r.schedule)
        label = name + (f" ({kw['solver']}{'+backfill' if kw.get('backfill') else ''})" if kw else "")
        res[label] = m
        rows.append([label, m["avg_latency"], m["p50_latency"], m["p99_latency"], m["makespan"], m["tel"] / lb, dt])
    sf = res["sorted-f (swap)"]["avg_latency"]
    for r in rows:
        r.insert(5, r[1] / sf)
    show(
        f"80/20 short/long mix, n = {n}, M = {MEMORY:,} (seed {seed}); cheap lower bound avg {lb / n:,.1f}",
        ["policy", "avg", "p50", "p99", "makespan", "× sorted-f", "× bound", "s"],
        rows,
    )
    mc = min(res["mcsf"]["avg_latency"], res["mcsf-skip"]["avg_latency"])
    console.print(
        f"fcfs / sorted-f = {res['fcfs']['avg_latency'] / sf:.2f}×   mcsf / sorted-f = "
        f"{res['mcsf']['avg_latency'] / sf:.2f}×   better mcsf variant / sorted-f = {mc / sf:.2f}×   "
        f"sorted-f / bound = {res['sorted-f (swap)']['tel'] / lb:.3f}"
    )


def scaled(seed: int, n: int, scale: int, memory: int) -> Workload:
    w0 = generate(MIX, n, seed)
    w = Workload.from_arrays(np.ceil(w0.s / scale).astype(int), np.ceil(w0.o / scale).astype(int))
    return w.check_memory(memory, drop_oversized=True)[0]


def lp_gap(seeds: int = 5) -> None:
    rows = []
    for n, scale, memory in [(50, 8, 2048), (100, 8, 2048)]:
        for seed in range(seeds):
            w = scaled(seed, n, scale, memory)
            tels = {
                p: summarize(w, run_policy(p, w, memory).schedule)["tel"]
                for p in ("fcfs", "mcsf", "mcsf-skip", "size", "sorted-f", "sorted-lp")
            }
            horizon = max(summarize(w, run_policy(p, w, memory).schedule)["makespan"] for p in ("sorted-f", "size"))
            (sol, dt) = timed(solve_lp, w, memory, horizon)
            rows.append(
                [
                    f"n={n} lengths/{scale} M={memory} seed {seed}",
                    cheap_bound(w, memory),
                    sol.bound,
                    *[tels[p] / sol.bound for p in tels],
                    dt,
                ]
            )
    show(
        "LP-sized instances (lengths of the 80/20 mix divided by 8): TEL / LP bound",
        ["instance", "cheap", "LP", "fcfs", "mcsf", "mcsf-skip", "size", "sorted-f", "sorted-lp", "LP s"],
        rows,
    )


def amin(seed: int = 1, n: int = 2000) -> None:
    w = generate(MIX, n, seed)
    exact = summarize(w, run_policy("sorted-f", w, MEMORY).schedule)["avg_latency"]
    rows = []
    for width in (0, 25, 50, 100, 200, 400):
        wp = with_width(w, width, seed)
        r, dt = timed(run_policy, "sorted-f-amin", wp, MEMORY)
        m = summarize(wp, r.schedule)
        rows.append([width, m["avg_latency"], m["avg_latency"] / exact, m["evictions"], m["peak_memory"], dt])
    for acc in (1.0, 0.749):
        wp = generate(MIX, n, seed, accuracy=acc, bucket=200)
        r, dt = timed(run_policy, "sorted-f-amin", wp, MEMORY)
        m = summarize(wp, r.schedule)
        rows.append(
            [
                f"200-buckets, {acc:.1%} right",
                m["avg_latency"],
                m["avg_latency"] / exact,
                m["evictions"],
                m["peak_memory"],
                dt,
            ]
        )
    show(
        f"sorted-f-amin vs prediction width (n = {n}, M = {MEMORY:,}); exact sorted-f avg {exact:,.1f}",
        ["range width", "avg", "× exact", "evictions", "peak", "s"],
        rows,
    )


def online(seed: int = 1, n: int = 2000) -> None:
    base = generate(MIX, n, seed)
    mean_area = float((base.s * base.o + base.o * (base.o + 1) / 2).mean())
    capacity = MEMORY / mean_area  # requests per step the budget could serve if perfectly packed
    rows = []
    for load in (0.5, 0.8, 0.95, 1.2):
        w = generate(MIX, n, seed, rate=load * capacity)
        row: list[object] = [f"{load:.2f} ({load * capacity:.3f}/step)"]
        for name, kw in [
            ("fcfs", {}),
            ("mcsf", {}),
            ("mcsf-skip", {}),
            ("sorted-f-online", {}),
            ("sorted-f-online", {"replan_every": 50}),
        ]:
            r, _ = timed(run_policy, name, w, MEMORY, **kw)
            row.append(summarize(w, r.schedule)["avg_latency"])
        rows.append(row)
    show(
        f"Online, Poisson arrivals (n = {n}, M = {MEMORY:,}): average latency in steps",
        ["load ρ", "fcfs", "mcsf", "mcsf-skip", "sorted-f-online", "online K=50"],
        rows,
    )


def speed() -> None:
    rows = []
    for n in (500, 1000, 2000, 4000):
        w = generate(MIX, n, 1)
        _, dt = timed(sorted_f_phase1, w.s, w.o, MEMORY, "swap")
        rows.append(["phase 1, swap", n, dt])
    for n in (10_000, 30_000, 100_000):
        w = generate(MIX, n, 1)
        _, dt = timed(sorted_f_phase1, w.s, w.o, MEMORY, "quantile")
        rows.append(["phase 1, quantile", n, dt])
    w = generate(MIX, 2000, 1)
    _, dt = timed(run_policy, "sorted-f", w, MEMORY, solver="swap")
    rows.append(["solve --solver swap (plan + execute)", 2000, dt])
    for n in (2000, 5000):  # what `tetrictl plan solve` runs by default: auto, default_evals(n) moves
        wn = generate(MIX, n, 1)
        how = Improve(max_evals=default_evals(n))
        _, dt = timed(run_policy, "sorted-f", wn, MEMORY, improvement=how)
        rows.append([f"solve --solver auto, {default_evals(n)} moves (seeds, moves, execute)", n, dt])
    big = generate(MIX, 100_000, 1)
    _, dt = timed(run_policy, "sorted-f", big, MEMORY, solver="quantile")
    rows.append(["solve --solver quantile (plan + execute)", 100_000, dt])
    for name in ("fcfs", "mcsf", "mcsf-skip", "size", "sorted-f"):
        _, dt = timed(run_policy, name, big, MEMORY)
        rows.append([f"simulate --policy {name}", 100_000, dt])
    pred = generate(MIX, 100_000, 1, accuracy=0.749)
    _, dt = timed(run_policy, "sorted-f-amin", pred, MEMORY)
    rows.append(["simulate --policy sorted-f-amin (74.9% buckets)", 100_000, dt])
    arriving = generate(MIX, 100_000, 1, rate=0.09)  # load ≈ 0.9
    _, dt = timed(run_policy, "sorted-f-online", arriving, MEMORY)
    rows.append(["simulate --policy sorted-f-online (re-plan at arrivals)", 100_000, dt])
    _, dt = timed(run_policy, "sorted-f-online", arriving, MEMORY, replan_every=50)
    rows.append(["simulate --policy sorted-f-online --replan-every 50", 100_000, dt])
    show(f"Speed (seconds, M = {MEMORY:,})", ["what", "n", "seconds"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["table", "lp", "amin", "online", "speed"])
    args = ap.parse_args()
    parts = {"table": paper_table, "lp": lp_gap, "amin": amin, "online": online, "speed": speed}
    for name, fn in parts.items():
        if args.only in (None, name):
            fn()


if __name__ == "__main__":
    main()
