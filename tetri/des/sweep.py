"""When does disaggregation win? A sweep of TetriInfer's setups against the colocated baselines.

For each workload and each GPU budget `gpus` (one instance = one GPU), at each load (× the first
baseline's throughput on a burst of the same requests on those GPUs: every budget's axis means the same
thing), every baseline runs colocated on all the GPUs, and TetriInfer runs every P:D split (1 … gpus − 1
prefill instances) at every ChunkSize, all on the same Poisson arrivals. A *point* is one TetriInfer run.

Goodput at an offered rate is the rate × the share of requests within their SLOs (requests served well
per second while arrivals keep coming; DistServe's goodput is the largest rate at which that share stays
above a target). perf/$ is goodput per dollar of provisioned GPUs: goodput × 3600 / (GPUs × $ per
GPU-hour). (The bench's `goodput_rps`, requests within SLO over first arrival → last finish, counts the
drain of the last long answers against the system; on a finite trace at a known rate this one does not.)

The *region map* says, per (workload, baseline, budget, load), the best TetriInfer setup, its perf/$
against the baseline's, and whether it wins (at least the baseline's perf/$, above 0); and per P:D split
the best ChunkSize's ratio.

Pure: plain data in (a `SweepSpec`), plain data out (JSON-ready dicts); a `runner` runs each
configuration (the simulator by default). The PNG is drawn by `tetrictl bench --sweep --plot`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from tetri.costmodel import DEFAULT_PROFILE
from tetri.scheduling.colocated import BASELINES

from .experiments import (
    TETRI,
    TETRI_POLICY,
    BenchSetup,
    Runner,
    calibrated_rate,
    des_runner,
    requests_for,
    tetri_config,
    vanilla_config,
)
from .metrics import summarize
from .slo import DEFAULT_SLO, SloSet
from .workloads import WorkloadSpecError, check_workload_name

Progress = Callable[[int, int], None]
KEPT = (  # the metrics each run keeps (the sweep's JSON stays readable)
    "avg_ttft_s",
    "p99_ttft_s",
    "avg_tpot_s",
    "p99_tpot_s",
    "avg_jct_s",
    "slo_attainment",
    "preemptions",
)


@dataclass(frozen=True)
class SweepSpec:
    workloads: tuple[str, ...] = ("Mixed",)
    profile: str = DEFAULT_PROFILE
    gpus: tuple[int, ...] = (4, 8)
    loads: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0, 16.0)  # × the first baseline's throughput on a burst
    chunks: tuple[int, ...] = (128, 256, 512, 1024)  # TetriInfer's ChunkSize
    baselines: tuple[str, ...] = BASELINES
    n: int = 512  # requests per point
    seed: int = 0
    price: float = 2.0
    slo: SloSet = field(default=DEFAULT_SLO)

    def __post_init__(self) -> None:
        if not self.workloads:
            raise WorkloadSpecError("a sweep needs at least one workload")
        for w in self.workloads:
            check_workload_name(w)
        if not self.gpus or any(g < 2 for g in self.gpus):
            raise WorkloadSpecError(f"--gpus: each budget needs at least 2 GPUs, got {list(self.gpus)}")
        if not self.loads or any(not 0 < x <= 100 for x in self.loads):
            raise WorkloadSpecError(f"--loads: each load must be within (0, 100], got {list(self.loads)}")
        if not self.chunks or any(c < 1 for c in self.chunks):
            raise WorkloadSpecError(f"--chunks: each ChunkSize must be at least 1 token, got {list(self.chunks)}")
        self.setup(self.gpus[0])  # the bench's own checks: n, price, baselines

    def setup(self, gpus: int) -> BenchSetup:
        return BenchSetup(
            profile=self.profile,
            instances=gpus,
            n=self.n,
            seed=self.seed,
            price=self.price,
            slo=self.slo,
            baselines=self.baselines,
        )

    @property
    def points(self) -> int:
        """TetriInfer runs in the sweep."""
        return len(self.workloads) * len(self.loads) * len(self.chunks) * sum(g - 1 for g in self.gpus)

    @property
    def runs(self) -> int:
        """Every simulated run: the points, the baselines, and one calibration per workload and budget."""
        per_budget = len(self.loads) * len(self.baselines) + 1
        return self.points + len(self.workloads) * len(self.gpus) * per_budget


def _noop(done: int, total: int) -> None:
    return None


def _kept(m: dict[str, Any], rate: float, gpus: int, price: float) -> dict[str, Any]:
    """The run's kept metrics, with its goodput and perf/$ at the offered `rate` (module docstring)."""
    out = {k: m[k] for k in KEPT}
    out["goodput_rps"] = rate * m["slo_attainment"]
    out["perf_per_dollar"] = out["goodput_rps"] * 3600.0 / (gpus * price)
    return out


def _ratio(new: float, base: float) -> float | None:
    return new / base if base else None


def run_sweep(spec: SweepSpec, runner: Runner = des_runner, progress: Progress = _noop) -> dict[str, Any]:
    """Every run of the sweep, each point's perf/$ against each baseline, and the region map."""
    done = 0
    total = spec.runs

    def tick() -> None:
        nonlocal done
        done += 1
        progress(done, total)

    points: list[dict[str, Any]] = []
    baselines: list[dict[str, Any]] = []
    capacity: dict[str, dict[int, float]] = {}
    for workload in spec.workloads:
        name = check_workload_name(workload)
        for g in spec.gpus:
            setup = spec.setup(g)
            full = calibrated_rate(name, replace(setup, load=1.0), runner)  # the first baseline on a burst
            capacity.setdefault(name, {})[g] = full
            tick()
            for load in spec.loads:
                rate = load * full
                requests = requests_for(name, setup, rate)
                base: dict[str, dict[str, Any]] = {}
                for b in spec.baselines:
                    run = summarize(runner(requests, vanilla_config(setup, b)), spec.price, spec.slo)
                    base[b] = _kept(run, rate, g, spec.price)
                    baselines.append({"workload": name, "gpus": g, "load": load, "baseline": b, "metrics": base[b]})
                    tick()
                for p in range(1, g):
                    for chunk in spec.chunks:
                        cfg = tetri_config(replace(setup, prefill_instances=p, chunk_size=chunk))
                        m = _kept(summarize(runner(requests, cfg), spec.price, spec.slo), rate, g, spec.price)
                        points.append(
                            {
                                "workload": name,
                                "gpus": g,
                                "load": load,
                                "rate_rps": rate,
                                "prefill": p,
                                "decode": g - p,
                                "chunk_size": chunk,
                                "metrics": m,
                                "perf_per_dollar_vs": {
                                    b: _ratio(m["perf_per_dollar"], base[b]["perf_per_dollar"]) for b in spec.baselines
                                },
                                "wins_vs": {
                                    b: m["perf_per_dollar"] > 0 and m["perf_per_dollar"] >= base[b]["perf_per_dollar"]
                                    for b in spec.baselines
                                },
                            }
                        )
                        tick()
    return {
        "spec": {
            "workloads": [check_workload_name(w) for w in spec.workloads],
            "profile": spec.profile,
            "gpus": list(spec.gpus),
            "loads": list(spec.loads),
            "chunks": list(spec.chunks),
            "baselines": list(spec.baselines),
            "n": spec.n,
            "seed": spec.seed,
            "price_per_gpu_hour": spec.price,
            "slo": spec.slo.to_dict(),
            "tetri_policy": TETRI_POLICY.to_dict() | {"chunk_size": "swept"},
            "load_reference": f"× {spec.baselines[0]}'s throughput on a burst of the same requests, same GPUs",
            "goodput": "offered rate × share of requests within their SLOs",
        },
        "capacity_rps": capacity,
        "baselines": baselines,
        "points": points,
        "regions": regions(points, spec.baselines),
        "systems": [TETRI, *spec.baselines],
    }


def regions(points: list[dict[str, Any]], baselines: tuple[str, ...] | list[str]) -> list[dict[str, Any]]:
    """Per (workload, baseline, GPUs, load): the best TetriInfer setup by perf/$, its ratio to the
    baseline's (None when the baseline has no request within its SLOs), whether it wins (its perf/$ at least
    the baseline's, and above 0), and the best of each P:D split over the ChunkSizes."""
    out: list[dict[str, Any]] = []
    cells: dict[tuple[str, int, float], list[dict[str, Any]]] = {}
    for pt in points:
        cells.setdefault((pt["workload"], pt["gpus"], pt["load"]), []).append(pt)
    for b in baselines:
        for (workload, g, load), pts in cells.items():
            best = max(pts, key=lambda p: p["metrics"]["perf_per_dollar"])
            by_split: dict[int, dict[str, Any]] = {}
            for p in pts:
                cur = by_split.get(p["prefill"])
                if cur is None or p["metrics"]["perf_per_dollar"] > cur["perf_per_dollar"]:
                    by_split[p["prefill"]] = {
                        "perf_per_dollar": p["metrics"]["perf_per_dollar"],
                        "ratio": p["perf_per_dollar_vs"][b],
                        "chunk_size": p["chunk_size"],
                    }
            out.append(
                {
                    "workload": workload,
                    "baseline": b,
                    "gpus": g,
                    "load": load,
                    "best": {"prefill": best["prefill"], "decode": best["decode"], "chunk_size": best["chunk_size"]},
                    "ratio": best["perf_per_dollar_vs"][b],
                    "wins": best["wins_vs"][b],
                    "by_split": {
                        str(k): {
                            "ratio": v["ratio"],
                            "chunk_size": v["chunk_size"],
                            # the baseline's perf/$ 0 (ratio None) and TetriInfer's above: a win
                            "wins": v["perf_per_dollar"] > 0 and (v["ratio"] is None or v["ratio"] >= 1.0),
                        }
                        for k, v in sorted(by_split.items())
                    },
                }
            )
    return out
