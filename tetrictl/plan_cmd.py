"""`tetrictl plan …`: the offline KV-budget planner (Sorted-F and baselines) from the terminal.

A thin shell: it reads and writes files, times the solves and prints; every decision is made by
`tetri.planner`. The planner (numpy, scipy) is imported inside the commands, so that the rest of
`tetrictl` starts without it.
"""

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from tetri.planner.errors import WorkloadError
from tetri.planner.names import POLICIES

if TYPE_CHECKING:
    from tetri.planner.bounds import Bound
    from tetri.planner.policies import Improve, PolicyResult
    from tetri.planner.workload import Workload

from .client import ClientError, Target, TetriClient
from .console import CtlConfigOpt, TokenOpt, UrlOpt, option, target, with_options
from .output import fail, print_json, progress, table, user_errors

app = typer.Typer(
    help="Offline KV-budget planner: Sorted-F, its solvers, baselines and lower bounds.",
    no_args_is_help=True,
    rich_markup_mode=None,  # help text is plain: [brackets] are text, not markup
)

WorkloadArg = Annotated[Path, typer.Argument(help="Workload, JSON Lines (one request a line).")]
MemoryOpt = Annotated[int, typer.Option("--memory", "-M", help="KV budget M in token slots.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print exactly one JSON document on stdout.")]
DropOpt = Annotated[bool, typer.Option("--drop-oversized", help="Drop requests with s+o > M instead of failing.")]
SolverOpt = Annotated[
    str,
    typer.Option(
        "--solver", help="Phase-1 solver: auto (then the improvement phase, --evals), dp, swap, quantile or lp."
    ),
]
BackfillOpt = Annotated[bool, typer.Option("--backfill", help="Backfill requests that finish before a blocked head.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed for sampling (quantile solver, generators).")]
EvalsOpt = Annotated[
    int | None,
    typer.Option(
        "--evals",
        help="With --solver auto: moves the improvement phase tries (sorted-f, sorted-f-amin; sorted-f-online's "
        "re-plan comparisons). Default: 50,000 ÷ the requests, at most 1,000 (about a second); 0: the best of "
        "its seeds only. The same input and options give the same plan on any machine.",
        show_default=False,
    ),
]
TimeLimitOpt = Annotated[
    float | None,
    typer.Option(
        "--time-limit",
        help="Also stop the improvement phase after this many seconds on the wall clock. Off by default: with "
        "it the plan depends on the machine's speed and load.",
        show_default=False,
    ),
]


def _improvement(evals: int | None, time_limit: float | None, seed: int, n: int = 1) -> "Improve":
    """The improvement phase's bounds for `n` requests: `evals` moves (default `default_evals(n)`) and, only
    when asked, a wall-clock limit (the shell's to read)."""
    from tetri.planner.improve import Budget, default_evals
    from tetri.planner.policies import Improve

    if evals is not None and evals < 0:
        raise WorkloadError(f"--evals must be a number of moves ≥ 0, got {evals}")
    if time_limit is not None and not (time_limit > 0 and math.isfinite(time_limit)):
        raise WorkloadError(f"--time-limit must be a number of seconds > 0, got {time_limit}")
    budget = Budget(time_limit, time.perf_counter) if time_limit is not None else Budget()
    return Improve(budget, max_evals=default_evals(n) if evals is None else evals, seed=seed)


@dataclass(frozen=True)
class Planning:
    """What solve, simulate and compare share: the solver and its bounds, --drop-oversized, --json."""

    solver: str = "auto"
    backfill: bool = False
    drop: bool = False
    seed: int = 0
    evals: int | None = None
    time_limit: float | None = None
    json_out: bool = False

    def check(self) -> None:
        """A bad solver or bound fails before any work (WorkloadError naming the option)."""
        from tetri.planner.solvers import check_solver

        check_solver(self.solver)
        self.improvement()

    def improvement(self, n: int = 1) -> "Improve":
        return _improvement(self.evals, self.time_limit, self.seed, n)


_PLANNING = (
    option("solver", SolverOpt, "auto"),
    option("backfill", BackfillOpt, False),
    option("drop", DropOpt, False),
    option("seed", SeedOpt, 0),
    option("evals", EvalsOpt),
    option("time_limit", TimeLimitOpt),
    option("json_out", JsonOpt, False),
)


def planning_command(fn: Callable[..., None]) -> Callable[..., None]:
    """solve, simulate and compare: `fn(how: Planning, …its own options)`, the shared options declared once."""
    return with_options(fn, _PLANNING, lambda own, shared: fn(Planning(**shared), **own), given="how")


def _load(path: Path, memory: int, drop: bool, why: str = "") -> "tuple[Workload, int]":
    """The workload at `path` checked against M (`why`: what M is, added to an oversize message)."""
    from tetri.planner.workload import parse_jsonl

    w = parse_jsonl(path.read_text(encoding="utf-8").splitlines(), source=str(path))
    try:
        kept, dropped = w.check_memory(memory, drop)
    except WorkloadError as e:
        raise WorkloadError(f"{e}{why}") from None
    if kept.n == 0:
        raise WorkloadError(f"{path}: no request left to plan: all {dropped} need more than M = {memory} KV slots")
    return kept, dropped


def _read_plan(path: Path) -> Any:
    from tetri.planner.planfile import parse_plan

    return parse_plan(path.read_text(encoding="utf-8"), source=str(path))


def _timed(fn: Any, *args: Any, **kw: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    res = fn(*args, **kw)
    return res, time.perf_counter() - t0


@app.command("gen")
def gen_cmd(
    mix: Annotated[
        str, typer.Option("--mix", help="Classes and shares, e.g. short:0.8,long:0.2.")
    ] = "short:0.8,long:0.2",
    n: Annotated[int, typer.Option("-n", help="Number of requests.")] = 2000,
    seed: SeedOpt = 0,
    output: Annotated[str, typer.Option("-o", "--output", help="Output file ('-' for stdout).")] = "-",
    rate: Annotated[float | None, typer.Option("--rate", help="Poisson arrivals, requests per step.")] = None,
    accuracy: Annotated[
        float | None, typer.Option("--accuracy", help="Add predicted ranges right with this probability.")
    ] = None,
    bucket: Annotated[int, typer.Option("--bucket", help="Width of a predicted range (tokens).")] = 200,
    json_out: JsonOpt = False,
) -> None:
    """Generate a synthetic workload (chat-like short, document-summarisation long)."""
    from tetri.planner import generate as gen
    from tetri.planner.workload import dump_jsonl

    with user_errors():
        if json_out and output == "-":
            raise WorkloadError("--json prints a summary: give the workload a file with -o")
        w = gen.generate(gen.Mix.parse(mix), n, seed, rate, accuracy, bucket)
        text = dump_jsonl(w)
        if output == "-":
            typer.echo(text, nl=False)
            return
        Path(output).write_text(text, encoding="utf-8")
    summary = {
        "path": output,
        "n": w.n,
        "mean_prompt_tokens": float(w.s.mean()),
        "mean_output_tokens": float(w.o.mean()),
        "max_peak_tokens": int(w.peak.max()),
        "last_arrival": int(w.a.max()),
        "predicted": w.lo is not None,
    }
    if json_out:
        print_json(summary)
    else:
        table(f"wrote {output}", ["field", "value"], list(summary.items()))


@app.command("solve")
@planning_command
def solve_cmd(
    how: Planning,
    workload: WorkloadArg,
    memory: Annotated[
        int | None, typer.Option("--memory", "-M", help="KV budget M in token slots (or --from-cluster).")
    ] = None,
    from_cluster: Annotated[
        bool,
        typer.Option(
            "--from-cluster",
            help="Take M (its KV capacity) and the context from a live decode instance (--instance, else the "
            "least busy), so that the plan fits it when replayed.",
        ),
    ] = False,
    instance: Annotated[str | None, typer.Option("--instance", help="With --from-cluster: this instance.")] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    config: CtlConfigOpt = None,
    policy: Annotated[str, typer.Option("--policy", help="sorted-f, sorted-f-amin or sorted-lp.")] = "sorted-f",
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Write the plan file here.")] = None,
) -> None:
    """Plan a backlog with Sorted-F and write the plan file (with its gap to the best lower bound)."""
    from tetri.planner.bounds import best_bound
    from tetri.planner.planfile import build_plan
    from tetri.planner.policies import check_policy, run_policy

    with user_errors():
        how.check()  # bad options fail before any work
        check_policy(policy)
        if how.solver == "lp":
            policy = "sorted-lp"
        if policy not in ("sorted-f", "sorted-f-amin", "sorted-lp"):
            raise WorkloadError(f"solve plans with sorted-f, sorted-f-amin or sorted-lp, not {policy!r}")
        if from_cluster and memory is not None:
            raise WorkloadError("--memory or --from-cluster (which takes M from the instance), not both")
        if not from_cluster and memory is None:
            raise WorkloadError("give --memory M, or --from-cluster to take it from a live decode instance")
        if instance is not None and not from_cluster:
            raise WorkloadError("--instance picks the instance of --from-cluster")
        cluster: dict[str, Any] | None = None
        if from_cluster:
            cluster = _decode_instance(target(url, token, config), instance)
            memory = int(cluster["kv_capacity_tokens"])
        assert memory is not None
        limit = min(memory, int(cluster["max_model_len"])) if cluster else memory
        why = (
            f" — {cluster['id']} holds {memory:,} KV slots and its model's context is "
            f"{cluster['max_model_len']:,} tokens"
            if cluster
            else ""
        )
        w, dropped = _load(workload, limit, how.drop, why)
        with progress("planning", how.json_out) as bar:
            res, wall = _timed(
                run_policy,
                policy,
                w,
                memory,
                solver=how.solver,
                backfill=how.backfill,
                seed=how.seed,
                progress=bar,
                improvement=how.improvement(w.n),
            )
        doc = build_plan(w, memory, res, dropped)
        if cluster is not None:
            doc["from_cluster"] = {k: cluster[k] for k in ("id", "model", "kv_capacity_tokens", "max_model_len")}
        doc["lower_bound"] = _bound_doc(best_bound(w, memory, int(res.schedule.finish.max())))
        doc["gap"] = doc["tel"] / doc["lower_bound"]["value"] if doc["lower_bound"]["value"] else None
        if output is not None:
            output.write_text(_dumps(doc), encoding="utf-8")
    shown = doc | {"wall_time_s": round(wall, 6)}  # how long planning took here: not in the plan file
    if how.json_out:
        print_json(shown)
        return
    _print_summary(f"{policy} ({res.solver}) plan" + (f" → {output}" if output else ""), shown)


def _decode_instance(tgt: "Target", wanted: str | None) -> dict[str, Any]:
    """The decode instance a plan is made for: `wanted`, or the active one with the fewest in flight."""

    async def fetch() -> list[dict[str, Any]]:
        async with TetriClient(tgt) as c:
            return await c.instances()

    try:
        decodes = [i for i in asyncio.run(fetch()) if i["role"] == "decode"]
    except ClientError as e:
        fail(e.message, e.code)
    if wanted is not None:
        hit = next((i for i in decodes if i["id"] == wanted), None)
        if hit is None:
            raise WorkloadError(f"--instance {wanted}: not a decode instance of this cluster")
        return hit
    active = [i for i in decodes if i["state"] == "active"]
    if not active:
        raise WorkloadError("--from-cluster: the cluster has no active decode instance")
    return min(active, key=lambda i: (i["inflight"], i["id"]))


def _bound_doc(bound: "Bound") -> dict[str, Any]:
    return {
        "value": bound.lower_bound,
        "method": bound.method,
        "cheap": bound.cheap,
        "lp": bound.lp,
        "detail": bound.detail,
    }


def _dumps(doc: Any) -> str:
    return json.dumps(doc, indent=1) + "\n"


def _print_summary(title: str, doc: dict[str, Any]) -> None:
    keys = ["n", "dropped", "tel", "avg_latency", "p50_latency", "p99_latency", "makespan", "peak_memory"]
    keys += ["evictions", "wall_time_s"]
    rows = [(k, doc[k]) for k in keys if k in doc]
    if "lower_bound" in doc:
        rows.append((f"lower bound ({doc['lower_bound']['method']})", doc["lower_bound"]["value"]))
        rows.append(("gap (TEL / bound)", doc["gap"]))
    if "solver_stats" in doc:
        stats = dict(doc["solver_stats"])
        imp = stats.pop("improvement", None)
        rows += [(f"solver {k}", v) for k, v in stats.items()]
        if imp is not None:
            seeds = ", ".join(f"{k} {v:,}" for k, v in imp["seed_tel"].items())
            rows.append(("improvement", f"from {imp['seed']}; {imp['moves_kept']} of {imp['moves_tried']} moves kept"))
            rows.append(("seeds (TEL)", seeds))
    table(title, ["metric", "value"], rows)


@app.command("simulate")
@planning_command
def simulate_cmd(
    how: Planning,
    workload: WorkloadArg,
    memory: Annotated[int | None, typer.Option("--memory", "-M", help="KV budget M (default: the plan's).")] = None,
    policy: Annotated[str, typer.Option("--policy", help=f"One of {', '.join(POLICIES)}.")] = "sorted-f",
    plan: Annotated[Path | None, typer.Option("--plan", help="Execute this plan file's order instead.")] = None,
    replan_every: Annotated[
        int | None,
        typer.Option("--replan-every", help="sorted-f-online: re-plan every K steps (default: at arrivals)."),
    ] = None,
) -> None:
    """Execute a policy (or a plan) on a workload: metrics and the full schedule."""
    from tetri.planner.metrics import summarize
    from tetri.planner.planfile import plan_order, schedule_rows
    from tetri.planner.policies import check_policy, run_order, run_policy

    with user_errors():
        check_policy(policy)
        how.check()  # bad options fail before any work
        if replan_every is not None and replan_every < 1:
            raise WorkloadError("--replan-every must be at least 1")
        the_plan = _read_plan(plan) if plan is not None else None
        if memory is None:
            if the_plan is None:
                raise WorkloadError("--memory is required (or give --plan)")
            memory = the_plan.memory
        w, dropped = _load(workload, memory, how.drop)
        if the_plan is not None:
            order = plan_order(the_plan, w, source=str(plan))
            sched, wall = _timed(run_order, w, memory, order, how.backfill or the_plan.backfill)
            name = f"plan:{the_plan.policy}"
        else:
            with progress(policy, how.json_out) as bar:
                res, wall = _timed(
                    run_policy,
                    policy,
                    w,
                    memory,
                    solver=how.solver,
                    backfill=how.backfill,
                    replan_every=replan_every,
                    seed=how.seed,
                    progress=bar,
                    improvement=how.improvement(w.n),
                )
            sched, name = res.schedule, policy
    doc: dict[str, Any] = {"policy": name, "memory": memory, "n": w.n, "dropped": dropped}
    doc.update(summarize(w, sched))
    doc["wall_time_s"] = round(wall, 6)
    doc["schedule"] = schedule_rows(w, sched)
    if how.json_out:
        print_json(doc)
        return
    _print_summary(f"{name} under M = {memory:,}", doc)


def _default_policies(w: "Workload", memory: int) -> list[str]:
    from tetri.planner.lp import LP_MAX_NONZEROS, lp_nonzeros

    names = ["fcfs", "mcsf", "mcsf-skip", "size", "area", "sorted-f"]
    horizon_guess = int(w.a.max() + w.o.sum())
    if lp_nonzeros(w, min(horizon_guess, 10 * int(w.o.max()) + int(w.a.max()))) <= LP_MAX_NONZEROS:
        names.append("sorted-lp")
    if w.lo is not None:
        names.append("sorted-f-amin")
    if int(w.a.max()) > 0:
        names.append("sorted-f-online")
    return names


@app.command("compare")
@planning_command
def compare_cmd(
    how: Planning,
    workload: WorkloadArg,
    memory: MemoryOpt,
    policies: Annotated[
        str | None, typer.Option("--policies", help="Comma-separated policies (default: all that apply).")
    ] = None,
    lp: Annotated[
        bool, typer.Option("--lp/--no-lp", help="Try the LP lower bound when the instance is small enough.")
    ] = True,
) -> None:
    """Compare policies: latency, makespan, ratio to the best policy and to the lower bound."""
    from tetri.planner.bounds import best_bound
    from tetri.planner.metrics import summarize
    from tetri.planner.policies import check_policy, run_policy

    with user_errors():
        how.check()  # bad options fail before any work
        w, dropped = _load(workload, memory, how.drop)
        names = [p.strip() for p in policies.split(",") if p.strip()] if policies else _default_policies(w, memory)
        for name in names:
            check_policy(name)
        results: dict[str, tuple[PolicyResult, float]] = {}
        with progress("comparing", how.json_out) as bar:
            for k, name in enumerate(names):
                results[name] = _timed(
                    run_policy,
                    name,
                    w,
                    memory,
                    solver=how.solver,
                    backfill=how.backfill,
                    seed=how.seed,
                    improvement=how.improvement(w.n),
                )
                bar(k + 1, len(names))
        horizon = min(int(r.schedule.finish.max()) for r, _ in results.values())
        bound = best_bound(w, memory, horizon, use_lp=lp)
    rows: list[dict[str, Any]] = []
    for name, (res, wall) in results.items():
        m = summarize(w, res.schedule)
        rows.append({"policy": name, "solver": res.solver, **m, "solve_time_s": round(wall, 6)})
    best = min(r["avg_latency"] for r in rows)
    for r in rows:
        r["ratio_to_best"] = r["avg_latency"] / best
        r["ratio_to_bound"] = r["tel"] / bound.lower_bound if bound.lower_bound else None
    doc = {
        "memory": memory,
        "n": w.n,
        "dropped": dropped,
        "lower_bound": _bound_doc(bound),
        "policies": rows,
    }
    if how.json_out:
        print_json(doc)
        return
    table(
        f"{w.n:,} requests, M = {memory:,}; lower bound {bound.lower_bound / w.n:,.1f} avg ({bound.method})",
        ["policy", "avg", "p50", "p99", "makespan", "× best", "× bound", "solve s"],
        [
            (
                r["policy"],
                r["avg_latency"],
                r["p50_latency"],
                r["p99_latency"],
                r["makespan"],
                r["ratio_to_best"],
                r["ratio_to_bound"],
                r["solve_time_s"],
            )
            for r in rows
        ],
    )


@app.command("bound")
def bound_cmd(
    workload: WorkloadArg,
    memory: MemoryOpt,
    lp: Annotated[bool, typer.Option("--lp/--no-lp", help="Try the LP relaxation when small enough.")] = True,
    drop: DropOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """A lower bound on total end-to-end latency (TEL) valid for every feasible schedule."""
    from tetri.planner.bounds import best_bound
    from tetri.planner.policies import run_policy

    with user_errors():
        w, _ = _load(workload, memory, drop)
        horizon = int(run_policy("sorted-f", w, memory).schedule.finish.max()) if lp else None
        b = best_bound(w, memory, horizon, use_lp=lp)
    doc = {
        "lower_bound": b.lower_bound,
        "method": b.method,
        "cheap": b.cheap,
        "lp": b.lp,
        "avg_latency_bound": b.lower_bound / w.n,
        "detail": b.detail,
    }
    if json_out:
        print_json(doc)
        return
    table("TEL lower bound", ["field", "value"], list(doc.items()))
