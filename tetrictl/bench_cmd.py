"""`tetrictl bench`: TetriInfer vs the vLLM baselines (vllm-v0, vllm-v1) on the paper's workloads.

A thin shell over `tetri.des.experiments`: it validates input, runs the experiments on the discrete-
event simulator (`--mode des`) or on live sim clusters started on loopback (`--mode live`, `bench_live`),
prints the paper-style table and optionally the ablations (simulator only), and draws a PNG.
"""

from pathlib import Path
from typing import Annotated, Any

import typer

from tetri.costmodel import DEFAULT_PROFILE, load_profile
from tetri.des.names import WORKLOADS
from tetri.scheduling.colocated import BASELINES

from .console import ProfileOpt
from .output import print_json, progress, table, user_errors


def bench(
    workloads: Annotated[
        str,
        typer.Option(
            "--workloads", help=f"Comma-separated workloads from {', '.join(WORKLOADS)} (default: all; --sweep: Mixed)."
        ),
    ] = "",
    n: Annotated[
        int | None, typer.Option("-n", help="Requests per workload (default 128; per point with --sweep: 512).")
    ] = None,
    instances: Annotated[int, typer.Option("--instances", help="GPUs per system (one instance each), ≥ 2.")] = 2,
    prefill_instances: Annotated[
        int | None, typer.Option("--prefill-instances", help="TetriInfer prefill instances (default: half).")
    ] = None,
    vanilla_instances: Annotated[
        int | None, typer.Option("--vanilla-instances", help="Instances of each baseline (default: --instances).")
    ] = None,
    baseline: Annotated[
        str,
        typer.Option(
            "--baseline",
            help="Comma-separated colocated baselines to compare with: vllm-v0 (the paper's: prefill-first, "
            "padded prompt batches), vllm-v1 (today's: chunked prefill mixed into decode batches); the first "
            "calibrates --load.",
        ),
    ] = ",".join(BASELINES),
    profile: ProfileOpt = DEFAULT_PROFILE,
    chunk_size: Annotated[
        int | None,
        typer.Option("--chunk-size", help="TetriInfer's ChunkSize (default: the profile's, or its roofline knee)."),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed for lengths, arrivals, predictor and dispatch.")] = 0,
    price: Annotated[float, typer.Option("--price", help="Dollars per GPU-hour, for perf/$.")] = 2.0,
    slo: Annotated[
        list[str] | None,
        typer.Option(
            "--slo",
            help="Latency SLOs for goodput and perf/$, seconds: 'ttft=1,tpot=0.1' (the default) or per class "
            "'HPLD:ttft=5' (LPLD, LPHD, HPLD, HPHD; repeatable).",
        ),
    ] = None,
    load: Annotated[
        float, typer.Option("--load", help="Arrival rate as a fraction of the first baseline's saturated throughput.")
    ] = 0.8,
    burst: Annotated[bool, typer.Option("--burst", help="All requests arrive at t = 0 (ignores --load).")] = False,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a PNG, one panel per metric.")] = None,
    ablations: Annotated[
        bool, typer.Option("--ablations", help="Also run the chunking, predictor and flip ablations.")
    ] = False,
    mode: Annotated[
        str, typer.Option("--mode", help="des (the simulator) or live (daemon + sim workers on loopback).")
    ] = "des",
    time_scale: Annotated[
        float, typer.Option("--time-scale", help="live: model seconds per wall second of the sim workers.")
    ] = 1.0,
    sweep: Annotated[
        bool,
        typer.Option(
            "--sweep",
            help="Sweep load × P:D split × ChunkSize × baseline on the simulator (default: Mixed, 512 requests "
            "a point) and say where TetriInfer's goodput per dollar wins.",
        ),
    ] = False,
    gpus: Annotated[str, typer.Option("--gpus", help="--sweep: GPU budgets, comma-separated.")] = "4,8",
    loads: Annotated[
        str, typer.Option("--loads", help="--sweep: loads, × the first baseline's throughput on a burst.")
    ] = "1,2,4,8,16",
    chunks: Annotated[str, typer.Option("--chunks", help="--sweep: TetriInfer ChunkSizes.")] = "128,256,512,1024",
    out_file: Annotated[
        Path | None, typer.Option("-o", "--output", help="--sweep: also write the JSON document here.")
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print exactly one JSON document on stdout.")] = False,
) -> None:
    """TetriInfer vs each vLLM baseline per workload (DES or live): TTFT, TPOT, JCT, goodput within the
    SLOs, cost (provisioned GPUs × wall time) and perf/$ (requests within their SLOs per dollar). With
    --sweep: the same question over loads, P:D splits, ChunkSizes and GPU budgets, with a region map."""
    from tetri.des.experiments import BenchSetup, des_runner, run_ablations, run_bench
    from tetri.des.slo import parse_slos
    from tetri.des.workloads import WorkloadSpecError, check_workload_name

    from .bench_live import live_runner

    if sweep:
        _sweep(workloads, n, profile, seed, price, slo, baseline, gpus, loads, chunks, mode, plot, out_file, json_out)
        return
    n = 128 if n is None else n
    with user_errors():
        names = [check_workload_name(w) for w in (workloads or ",".join(WORKLOADS)).split(",") if w.strip()]
        if not names:
            raise WorkloadSpecError("--workloads names no workload")
        try:
            load_profile(profile)
        except ValueError as e:
            raise WorkloadSpecError(str(e)) from None
        setup = BenchSetup(
            profile=profile,
            instances=instances,
            prefill_instances=prefill_instances,
            vanilla_instances=vanilla_instances,
            n=n,
            seed=seed,
            price=price,
            load=load,
            burst=burst,
            slo=parse_slos(slo or []),
            baselines=tuple(b.strip().lower() for b in baseline.split(",") if b.strip()),
            chunk_size=chunk_size,
        )
        if mode not in ("des", "live"):
            raise WorkloadSpecError(f"--mode must be des or live, not {mode!r}")
        if mode == "live" and ablations:
            raise WorkloadSpecError("--ablations run on the simulator only (--mode des)")
        if not time_scale > 0:
            raise WorkloadSpecError("--time-scale must be positive")
        if plot is not None and plot.parent and not plot.parent.is_dir():
            raise WorkloadSpecError(f"cannot write the plot: {plot.parent} is not a directory")
    total = len(names) + (3 if ablations else 0)
    with progress("bench", json_out) as bar:
        runner = live_runner(time_scale) if mode == "live" else des_runner
        doc = run_bench(names, setup, runner, progress=bar, mode=mode)
        if ablations:
            doc["ablations"] = run_ablations(setup, progress=lambda k, _: bar(len(names) + k, total))
    if plot is not None:
        with user_errors():
            write_plot(doc, plot)
        doc["plot"] = str(plot)
    if json_out:
        print_json(doc)
        return
    print_tables(doc)
    if plot is not None:
        typer.echo(f"plot written to {plot}")


def _change(key: str, v: float | None) -> str:
    from tetri.des.metrics import RATIOS

    if v is None:
        return "—"
    if key in RATIOS:
        return f"{v:.2f}×"
    return f"{v:+.0%}".replace("-", "−")


def print_tables(doc: dict[str, Any]) -> None:
    from tetri.des.experiments import TETRI

    s = doc["setup"]
    metrics = doc["metrics"]
    split = s["tetri_split"]
    baselines = s["baselines"]
    arrivals = "burst at t = 0" if s["load"] is None else f"Poisson at {s['load']:g} × {baselines[0]}'s saturated rate"
    head = (
        f"{s['profile']}, n = {s['n']}, seed {s['seed']}, {arrivals}; TetriInfer {split['prefill']}P+{split['decode']}D"
        f" vs ×{s['vanilla_instances']} colocated; SLO {s['slo']['label']}"
    )
    for b in baselines:
        table(
            f"TetriInfer vs {b} ({doc['mode'].upper()}): change — {head}",
            ["workload", *[m["label"] for m in metrics]],
            [
                (w["workload"], *[_change(m["key"], w["change"][b][m["key"]]) for m in metrics])
                for w in doc["workloads"]
            ],
        )
    rows = []
    for w in doc["workloads"]:
        rate = "burst" if w["rate_rps"] is None else f"{w['rate_rps']:.3g}/s"
        for system in (TETRI, *baselines):
            m = w["systems"][system]
            rows.append((w["workload"], rate, system, *[m[x["key"]] for x in metrics], m["preemptions"]))
    table("absolute values", ["workload", "rate", "system", *[m["label"] for m in metrics], "preemptions"], rows)
    if "ablations" in doc:
        print_ablations(doc["ablations"])


def print_ablations(a: dict[str, Any]) -> None:
    c = a["chunking"]
    table(
        f"ablation 1 — prefill: chunked vs fixed batch × fcfs/sjf, {c['workload']}, n = {c['n']}",
        ["prefill", "order", "avg prefill latency (s)", "vs fixed+fcfs", "avg prefill wait (s)", "wait vs fcfs", "pad"],
        [
            (
                r["prefill"],
                r["order"],
                r["avg_prefill_latency_s"],
                _change("", r["latency_change_vs_fixed_fcfs"]),
                r["avg_prefill_wait_s"],
                _change("", r["wait_change_vs_fcfs"]),
                r["padding_tokens"],
            )
            for r in c["rows"]
        ],
    )
    p = a["predictor"]
    table(
        f"ablation 2 — predictor × decode admission, {p['workload']} at {p['rate_rps']:.3g}/s, n = {p['n']}",
        ["predictor", "admission", "point", "avg JCT (s)", "p99 JCT (s)", "preemptions", "recomputed", "makespan (s)"],
        [
            (
                r["predictor"],
                r["admission"],
                r["reserve_point"],
                r["avg_jct_s"],
                r["p99_jct_s"],
                r["preemptions"],
                r["recomputed_tokens"],
                r["makespan_s"],
            )
            for r in p["rows"]
        ],
    )
    f = a["flip"]
    split = f["start_split"]
    table(
        f"ablation 3 — instance flips, {f['workload']}, start {split['prefill']}P+{split['decode']}D,"
        f" window {f['window_s']:g}s",
        ["system", "avg TTFT (s)", "avg JCT (s)", "p99 JCT (s)", "makespan (s)", "cost (GPU·s)", "flips"],
        [
            (
                r["system"],
                r["avg_ttft_s"],
                r["avg_jct_s"],
                r["p99_jct_s"],
                r["makespan_s"],
                r["cost_gpu_s"],
                ", ".join(f"{x['instance']} {x['from']}→{x['to']} at {x['done_s']:.0f}s" for x in r["flips"]) or "—",
            )
            for r in f["rows"]
        ],
    )


def write_plot(doc: dict[str, Any], path: Path) -> None:
    """One panel per headline metric: grouped bars (TetriInfer and each baseline) per workload, on log scales
    (the workloads differ by orders of magnitude) unless a value is 0 (no request within the SLOs)."""
    import matplotlib

    from tetri.des.experiments import TETRI

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    metrics = doc["metrics"]
    rows = doc["workloads"]
    names = [w["workload"] for w in rows]
    x = np.arange(len(names))
    cols = 3
    nrows = (len(metrics) + cols - 1) // cols
    systems = (TETRI, *doc["setup"]["baselines"])
    width = 0.8 / len(systems)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
    for k, m in enumerate(metrics):
        ax = axes[k // cols][k % cols]
        for j, system in enumerate(systems):
            vals = [w["systems"][system][m["key"]] for w in rows]
            ax.bar(x + (j - (len(systems) - 1) / 2) * width, vals, width, label=system)
        label = m["label"].replace("$", r"\$")  # not mathtext
        ax.set_title(f"{label} ({m['better']} is better)", fontsize=9)
        ax.set_xticks(x, names, fontsize=8)
        if all(w["systems"][sy][m["key"]] > 0 for w in rows for sy in systems):
            ax.set_yscale("log")
        ax.tick_params(axis="y", labelsize=8)
    for k in range(len(metrics), nrows * cols):
        axes[k // cols][k % cols].axis("off")
    axes[0][0].legend(fontsize=8)
    s = doc["setup"]
    fig.suptitle(
        f"TetriInfer vs {', '.join(s['baselines'])} ({doc['mode'].upper()}) — {s['profile']}, n = {s['n']}", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _sweep(
    workloads: str,
    n: int | None,
    profile: str,
    seed: int,
    price: float,
    slo: list[str] | None,
    baseline: str,
    gpus: str,
    loads: str,
    chunks: str,
    mode: str,
    plot: Path | None,
    out_file: Path | None,
    json_out: bool,
) -> None:
    from tetri.des.slo import parse_slos
    from tetri.des.sweep import SweepSpec
    from tetri.des.workloads import WorkloadSpecError

    from .sweep_cmd import floats, ints, print_sweep, write_json, write_region_map
    from .sweep_cmd import sweep as run_sweep_cli

    with user_errors():
        if mode != "des":
            raise WorkloadSpecError("--sweep runs on the simulator only (--mode des)")
        try:
            load_profile(profile)
        except ValueError as e:
            raise WorkloadSpecError(str(e)) from None
        spec = SweepSpec(
            workloads=tuple(w.strip() for w in (workloads or "Mixed").split(",") if w.strip()),
            profile=profile,
            gpus=ints(gpus, "--gpus"),
            loads=floats(loads, "--loads"),
            chunks=ints(chunks, "--chunks"),
            baselines=tuple(b.strip().lower() for b in baseline.split(",") if b.strip()),
            n=512 if n is None else n,
            seed=seed,
            price=price,
            slo=parse_slos(slo or []),
        )
        for path, what in ((plot, "the region map"), (out_file, "the JSON")):
            if path is not None and path.parent and not path.parent.is_dir():
                raise WorkloadSpecError(f"cannot write {what}: {path.parent} is not a directory")
    doc = run_sweep_cli(spec, json_out)
    with user_errors():
        if out_file is not None:
            write_json(doc, out_file)
        if plot is not None:
            write_region_map(doc, plot)
    if plot is not None:
        doc["plot"] = str(plot)
    if json_out:
        print_json(doc)
        return
    print_sweep(doc)
    for path, what in ((out_file, "JSON"), (plot, "region map")):
        if path is not None:
            typer.echo(f"{what} written to {path}")
