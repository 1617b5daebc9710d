"""`tetrictl advise`: which setup to run for a workload, and (`--apply`) make a live cluster run it.

The advice comes from the simulator (`tetri.des.advise`, pure); this shell reads the workload (a JSONL
trace — `tetrictl requests export` writes one from a live cluster — or a named mix at a rate), prints the
advice beside the best colocated setup, and with `--apply` changes the live cluster over the admin API:
the policies in one audited change, then one flip at a time until each role (colocated, prefill, decode)
has the advice's count.
"""

import asyncio
import math
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from tetri.costmodel import DEFAULT_PROFILE, load_profile
from tetri.scheduling.flip import ROLES, flip_path

from .client import ClientError, TetriClient
from .console import CtlConfigOpt, JsonOpt, ProfileOpt, TokenOpt, UrlOpt, call, target
from .flip_cmd import wait_flip
from .output import out, print_json, progress, table, user_errors

if TYPE_CHECKING:
    from tetri.des.workloads import Request


def _requests(
    trace: Path | None, workload: str | None, rate: float | None, n: int, seed: int, profile: str
) -> "list[Request]":
    from tetri.des.sessions import SESSION_MIXES, make_sessions
    from tetri.des.trace import read_trace
    from tetri.des.workloads import WorkloadSpecError, check_workload_name, make_workload

    if (trace is None) == (workload is None):
        raise WorkloadSpecError("give the workload as --trace FILE or as --workload NAME --rate R (one of them)")
    model = load_profile(profile).model
    if trace is not None:
        try:
            with trace.open(encoding="utf-8") as f:
                return read_trace(f, model.max_model_len)
        except UnicodeDecodeError:
            raise WorkloadSpecError(f"--trace {trace}: not UTF-8 text (a JSONL trace)") from None
    assert workload is not None
    if rate is None or not (rate > 0 and math.isfinite(rate)):
        raise WorkloadSpecError("--workload needs --rate, requests per second (> 0)")
    if n < 1:
        raise WorkloadSpecError(f"-n must be at least 1, got {n}")
    if workload.strip().lower() in SESSION_MIXES:
        return make_sessions(workload.strip().lower(), n, rate, seed, max_model_len=model.max_model_len)
    return make_workload(check_workload_name(workload), n, seed, rate, max_model_len=model.max_model_len)


def describe(setup: dict[str, Any]) -> str:
    p = setup["policies"]
    if setup["mode"] == "colocated":
        text = f"colocated ×{setup['colocated']} as {p['colocated_schedule']}"
        if p.get("queue_order", "fcfs") != "fcfs":
            text += f", {p['queue_order']} order ({p['predictor']} predictor at {p['predictor_accuracy']:.1%})"
        if p.get("ttft_target_s"):
            late = "rejected (429)" if p.get("ttft_miss") == "reject" else "last"
            text += f", requests past a {p['ttft_target_s']:g} s TTFT {late}"
        if p.get("token_budget"):
            text += f", {p['token_budget']} tokens an iteration while no prompt is urgent"
        return text
    split = (
        f"{setup['prefill']}P+{setup['decode']}D, ChunkSize {p['chunk_size']}, {p['prefill_policy']} prefill, "
        f"{p['decode_admission']} admission"
    )
    if setup["mode"] == "hybrid":
        return (
            f"{setup['colocated']} colocated ({p['colocated_schedule']}) + {split}; prompts of "
            f"{p['pd_prompt_tokens']} tokens or more split"
        )
    return split


def advise_cmd(
    trace: Annotated[Path | None, typer.Option("--trace", help="A JSONL trace (tetrictl requests export).")] = None,
    workload: Annotated[
        str | None,
        typer.Option(
            "--workload",
            help="Or a named mix (with --rate): LPLD, LPHD, HPLD, HPHD, Mixed, or one whose prompts repeat: "
            "chat-sessions, agent, rag-docs.",
        ),
    ] = None,
    rate: Annotated[float | None, typer.Option("--rate", help="--workload: requests per second.")] = None,
    n: Annotated[int, typer.Option("-n", help="--workload: requests.")] = 256,
    profile: ProfileOpt = DEFAULT_PROFILE,
    gpus: Annotated[int, typer.Option("--gpus", help="GPUs (instances) to spend.")] = 4,
    slo: Annotated[
        list[str] | None,
        typer.Option("--slo", help="SLOs, seconds: 'ttft=1,tpot=0.1' (the default) or per class 'HPLD:ttft=5'."),
    ] = None,
    price: Annotated[float, typer.Option("--price", help="Dollars per GPU-hour.")] = 2.0,
    baseline: Annotated[str, typer.Option("--baseline", help="Colocated baselines to consider.")] = "vllm-v0,vllm-v1",
    chunks: Annotated[
        str | None, typer.Option("--chunks", help="ChunkSizes to try (default: the profile's, 256, 512, 1024).")
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the named mix and the simulator.")] = 0,
    ttft_miss: Annotated[
        str,
        typer.Option(
            "--ttft-miss",
            help="What colocated setups may do with a request past the SLO's TTFT: last, or last,reject to also "
            "try answering it 429 (reject: clients see rejections).",
        ),
    ] = "last",
    mode: Annotated[
        str,
        typer.Option(
            "--mode",
            help="Setups to consider: any, or one or more of colocated, disaggregated, hybrid (colocated, prefill "
            "and decode instances at once, each request split or not by its prompt's length; 3 GPUs or more).",
        ),
    ] = "any",
    apply: Annotated[
        bool, typer.Option("--apply", help="Make the live cluster at --url run the advice (policies, then flips).")
    ] = False,
    timeout: Annotated[float, typer.Option(help="--apply: seconds to wait for each flip.")] = 600.0,
    url: UrlOpt = None,
    token: TokenOpt = None,
    config: CtlConfigOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Recommend colocated or a P:D split with its ChunkSize, prefill order and decode admission for a
    workload, with the expected goodput, TTFT/TPOT percentiles and $ per million tokens beside the best
    colocated setup (the simulator, the workload's own arrivals), and whether to route by the prefix cache
    (cache-aware) or by load alone (least-load). --apply: set the policies and flip instances on the live
    cluster to match (audited like any policy change and flip)."""
    from tetri.des.advise import MODES, AdviceSpec, advise
    from tetri.des.slo import parse_slos

    from .sweep_cmd import ints

    with user_errors():
        spec = AdviceSpec(
            profile=profile,
            gpus=gpus,
            slo=parse_slos(slo or []),
            price=price,
            chunks=ints(chunks, "--chunks") if chunks else (),
            baselines=tuple(b.strip().lower() for b in baseline.split(",") if b.strip()),
            seed=seed,
            ttft_misses=tuple(m.strip().lower() for m in ttft_miss.split(",") if m.strip()),
            modes=MODES
            if mode.strip().lower() == "any"
            else tuple(m.strip() for m in mode.lower().split(",") if m.strip()),
        )
        requests = _requests(trace, workload, rate, n, seed, profile)
    tgt = target(url, token, config) if apply else None
    if tgt is not None:  # a cluster of another size, or none at all, is refused before the simulation runs
        call(tgt, lambda c: _serving(c, gpus), lambda _: None, False)
    with user_errors(), progress("advise", json_out) as bar:
        doc = advise(requests, spec, progress=bar)
    if tgt is not None:
        doc["applied"] = call(tgt, lambda c: apply_advice(c, doc, timeout), lambda _: None, False)
    if json_out:
        print_json(doc)
        return
    render(doc)


def render(doc: dict[str, Any]) -> None:
    rows = []
    for label, setup in (("advice", doc["advice"]), ("best colocated", doc["best_colocated"])):
        if setup is None:  # --mode disaggregated: no colocated setup was tried
            continue
        o = setup["outcome"]
        rows.append(
            (
                label,
                describe(setup),
                o["goodput_rps"],
                f"{o['within_slo']:.0%}",
                o["p50_ttft_s"],
                o["p99_ttft_s"],
                o["p50_tpot_s"],
                o["p99_tpot_s"],
                o["usd_per_m_tokens"],
            )
        )
    rate = "a burst" if doc["offered_rps"] is None else f"{doc['offered_rps']:.3g} req/s"
    table(
        f"{doc['requests']} requests at {rate} on {doc['gpus']} × {doc['profile']}; SLO {doc['slo']['label']}",
        ["", "setup", "goodput (req/s)", "within SLO", "p50 TTFT", "p99 TTFT", "p50 TPOT", "p99 TPOT", "$/M tokens"],
        rows,
    )
    routing = doc.get("routing")
    if routing:
        told = [
            f"{name} {o['goodput_rps']:.3g} req/s (p50 TTFT {o['p50_ttft_s']:.3g} s)"
            for name, o in routing["outcomes"].items()
        ]
        out.print(f"routing: {routing['pick']} (the advice's setup routed {'; '.join(told)})")
    applied = doc.get("applied")
    if applied:
        flips = ", ".join(f"{f['instance_id']} → {f['to_role']}" for f in applied["flips"]) or "none"
        out.print(f"applied: policies changed {', '.join(applied['changed']) or 'none'}; flips {flips}")


# The policies an advice sets: the ones the simulator ran it with. The flip watcher's are the operator's.
APPLIED = {
    "disaggregated": (
        "routing",
        "cache_slack",
        "prefill_policy",
        "prefill_sched_batch",
        "chunk_size",
        "predictor",
        "predictor_accuracy",
        "predictor_granularity",
        "dispatch",
        "decode_admission",
        "reserve_point",
    ),
    "colocated": (
        "routing",
        "cache_slack",
        "colocated_schedule",
        "decode_admission",
        "queue_order",
        "aging_admissions",
        "ttft_target_s",
        "ttft_miss",
        "token_budget",
        "predictor",
        "predictor_accuracy",
        "predictor_granularity",
        "reserve_point",
    ),
}
APPLIED["hybrid"] = (
    *APPLIED["disaggregated"],
    *APPLIED["colocated"],
    "pd_route",
    "pd_prompt_tokens",
    "pd_output_tokens",
    "pd_backlog_slack",
)


async def _serving(c: TetriClient, gpus: int) -> list[dict[str, Any]]:
    """The cluster's instances, refused unless all `gpus` of them are active (none unhealthy, flipping or
    draining: --apply changes a settled cluster)."""
    insts = await c.instances()
    busy = [f"{i['id']} ({i['state']})" for i in insts if i["state"] != "active"]
    if busy:
        raise ClientError(f"not every instance is active ({', '.join(busy)}): apply when the cluster has settled")
    if len(insts) != gpus:
        raise ClientError(f"the cluster has {len(insts)} instances; the advice is for {gpus} (advise with --gpus)")
    return insts


async def apply_advice(c: TetriClient, doc: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Change the live cluster to the advice: the policies it was simulated with (`APPLIED`, one audited
    change), then the fewest flips that give each role its count (`flip_path`: one at a time, a flip drains its
    instance first, and none leaves the model unserved);
    then every worker runs them. A flip that fails stops it there, with the policies already set."""
    advice = doc["advice"]
    live = await _serving(c, doc["gpus"])
    roles = Counter(i["role"] for i in live)
    want = describe(advice)
    goal = {r: advice.get(r, 0) for r in ROLES} if advice["mode"] != "colocated" else {"colocated": doc["gpus"]}
    moves = flip_path(roles, goal)
    if moves is None:
        raise ClientError(f"the advice is {want}: no sequence of flips gets there from this cluster")
    current = (await c.policies())["policies"]
    policies = advice["policies"]
    changes = {k: policies[k] for k in APPLIED[advice["mode"]] if current.get(k) != policies[k]}
    if changes:
        await c.set_policies(changes)
    flips: list[dict[str, Any]] = []
    for role, to in moves:  # one at a time, each allowed when it starts (flip_path)
        inst = min((i for i in await c.instances() if i["role"] == role), key=lambda i: i["id"])
        started = await c.flip(inst["id"], to, reason=f"tetrictl advise: {want}")
        row = await wait_flip(c, started["id"], timeout)
        if row.get("outcome") != "done":
            raise ClientError(f"flip {row['id']} of {inst['id']} ended {row.get('outcome')}")
        flips.append(row)
    version = (await c.policies())["version"]
    deadline = time.monotonic() + 30
    while {i["policy_version"] for i in await c.instances()} != {version}:
        if time.monotonic() > deadline:
            raise ClientError("the workers have not taken the new policies after 30 s")
        await asyncio.sleep(0.1)
    return {"changed": sorted(changes), "flips": flips, "policy_version": version}
