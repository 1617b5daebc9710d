"""`tetrictl policy show|set|history`: the runtime scheduling policies (hot-swap) over the admin API."""

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from tetri.scheduling.colocated import COLOCATED_SCHEDULES
from tetri.scheduling.dispatch import DISPATCH_POLICIES
from tetri.scheduling.names import ADMISSION_POLICIES, PREDICTORS, QUEUE_ORDERS, RESERVE_POINTS, TTFT_MISSES
from tetri.scheduling.policyset import PolicySet
from tetri.scheduling.prefill import PREFILL_POLICIES
from tetri.scheduling.presets import PRESET_NAMES, PRESETS, PresetError, advised_policies
from tetri.scheduling.routing import PD_ROUTES

from .client import TetriClient
from .console import Daemon, daemon_command
from .output import fail, out, table

app = typer.Typer(
    help="Scheduling policies, changed at runtime without restart.", no_args_is_help=True, rich_markup_mode=None
)


def _choices(names: tuple[str, ...]) -> str:
    return ", ".join(names)


@app.command("show")
@daemon_command
def show(daemon: Daemon) -> None:
    """Every runtime policy and the version the workers acknowledge."""

    async def body(c: TetriClient) -> dict[str, Any]:
        return await c.policies()

    def render(d: dict[str, Any]) -> None:
        table(f"policies (version {d['version']})", ("field", "value"), list(d["policies"].items()))

    daemon.call(body, render)


PresetOpt = Annotated[
    str | None,
    typer.Option(
        "--policies",
        help=f"Start from a named policy set: {_choices(PRESET_NAMES)} (vllm-v1: vLLM's own schedule, FCFS, no "
        "predictor, no flips; tetriinfer: the paper's ChunkSize, SJF prefill, learned length predictor, "
        "power-of-two dispatch, reserve-dynamic admission, idle flips; advised: the policies of --advice FILE).",
    ),
]
AdviceOpt = Annotated[
    Path | None, typer.Option("--advice", help="--policies advised: the JSON that tetrictl advise --json wrote.")
]


def preset_policies(name: str, advice: Path | None) -> PolicySet:
    """The policy set `--policies NAME` names (exit 2 with one line on a bad name or advice file)."""
    if advice is not None and name != "advised":
        fail("--advice goes with --policies advised")
    if name == "advised":
        if advice is None:
            fail("--policies advised needs --advice FILE (the JSON that tetrictl advise --json wrote)")
        try:
            return advised_policies(json.loads(advice.read_text()))
        except OSError as e:
            fail(f"--advice: cannot read {advice}: {e.strerror}")
        except json.JSONDecodeError as e:
            fail(f"--advice: {advice} is not JSON (line {e.lineno}: {e.msg})")
        except PresetError as e:
            fail(f"--advice: {e}")
    if name not in PRESETS:
        fail(f"--policies must be one of {_choices(PRESET_NAMES)}, not {name!r}")
    return PRESETS[name]


@app.command("set")
@daemon_command
def set_(
    daemon: Daemon,
    policies: PresetOpt = None,
    advice: AdviceOpt = None,
    prefill: Annotated[
        str | None, typer.Option("--prefill", help=f"Prefill order: {_choices(PREFILL_POLICIES)}.")
    ] = None,
    sched_batch: Annotated[int | None, typer.Option("--sched-batch", help="PrefillSchedBatch (≥ 1).")] = None,
    chunk: Annotated[int | None, typer.Option("--chunk", help="ChunkSize, tokens per prefill iteration (≥ 1).")] = None,
    predictor: Annotated[str | None, typer.Option("--predictor", help=f"{_choices(PREDICTORS)}.")] = None,
    accuracy: Annotated[float | None, typer.Option("--accuracy", help="Oracle predictor accuracy (0–1).")] = None,
    granularity: Annotated[int | None, typer.Option("--granularity", help="Predictor bucket, tokens.")] = None,
    dispatch: Annotated[str | None, typer.Option("--dispatch", help=f"{_choices(DISPATCH_POLICIES)}.")] = None,
    decode: Annotated[
        str | None, typer.Option("--decode", help=f"Decode admission: {_choices(ADMISSION_POLICIES)}.")
    ] = None,
    reserve_point: Annotated[
        str | None,
        typer.Option(
            "--reserve-point", help=f"Point of a predicted bucket reserve policies count: {_choices(RESERVE_POINTS)}."
        ),
    ] = None,
    colocated_schedule: Annotated[
        str | None,
        typer.Option(
            "--colocated-schedule", help=f"How colocated instances schedule: {_choices(COLOCATED_SCHEDULES)}."
        ),
    ] = None,
    queue_order: Annotated[
        str | None,
        typer.Option(
            "--queue-order",
            help=f"The order decode and colocated instances admit waiting requests in: {_choices(QUEUE_ORDERS)} "
            "(srpt: least predicted work first, with aging).",
        ),
    ] = None,
    aging: Annotated[
        int | None,
        typer.Option("--aging", help="srpt: a request waiting while this many others are admitted goes first (≥ 1)."),
    ] = None,
    ttft_target: Annotated[
        float | None,
        typer.Option(
            "--ttft-target",
            help="Colocated: seconds; a request waiting longer goes after those that can still meet it (0: off).",
        ),
    ] = None,
    ttft_miss: Annotated[
        str | None,
        typer.Option(
            "--ttft-miss",
            help=f"A request past --ttft-target goes {_choices(TTFT_MISSES)} (last, colocated: after those that "
            "can still meet it; reject, colocated and prefill instances: answered 429 with Retry-After, recorded "
            "rejected).",
        ),
    ] = None,
    token_budget: Annotated[
        int | None,
        typer.Option(
            "--token-budget",
            help="Colocated vllm-v1: tokens an iteration while no prompt has waited half its --ttft-target "
            "(fewer prompt tokens beside the decodes: lower TPOT); 0: the engine's max_num_batched_tokens.",
        ),
    ] = None,
    pd_route: Annotated[
        str | None,
        typer.Option(
            "--pd-route",
            help=f"Where the model has colocated and prefill/decode instances, each request runs colocated or "
            f"split by: {_choices(PD_ROUTES)} (role: colocated; split: split; length: split the prompts of "
            "--pd-prompt-tokens or more and, with --pd-output-tokens, the long predicted outputs, unless that path "
            "is backed up).",
        ),
    ] = None,
    pd_prompt_tokens: Annotated[
        int | None, typer.Option("--pd-prompt-tokens", help="--pd-route length: prompts this long run split (≥ 1).")
    ] = None,
    pd_output_tokens: Annotated[
        int | None,
        typer.Option(
            "--pd-output-tokens",
            help="--pd-route length: and requests predicted to produce this many tokens (the upper end of the "
            "length predictor's range; 0 or --predictor none: not considered).",
        ),
    ] = None,
    pd_backlog_slack: Annotated[
        int | None,
        typer.Option(
            "--pd-backlog-slack",
            help="--pd-route length: the other path when the chosen one has more than this many more requests "
            "waiting (0: the length alone decides).",
        ),
    ] = None,
    routing: Annotated[
        str | None,
        typer.Option(
            "--routing",
            help="The entry instance: cache-aware (the one holding most of the prompt in its prefix cache, within "
            "--cache-slack of the least loaded), least-load, or round-robin.",
        ),
    ] = None,
    cache_slack: Annotated[
        int | None,
        typer.Option(
            "--cache-slack",
            help="--routing cache-aware: an instance holding the prompt's prefix is chosen only while it has at most "
            "this many more requests waiting or running than the least loaded.",
        ),
    ] = None,
) -> None:
    """Change policies; the daemon validates them together (a bad value: exit 2 naming the field),
    applies them without restart and records each change in the audit table. --policies NAME sets every
    field to that named set first; the other flags change fields of it."""
    given = {
        "prefill_policy": prefill,
        "prefill_sched_batch": sched_batch,
        "chunk_size": chunk,
        "predictor": predictor,
        "predictor_accuracy": accuracy,
        "predictor_granularity": granularity,
        "dispatch": dispatch,
        "decode_admission": decode,
        "reserve_point": reserve_point,
        "colocated_schedule": colocated_schedule,
        "queue_order": queue_order,
        "aging_admissions": aging,
        "ttft_target_s": ttft_target,
        "ttft_miss": ttft_miss,
        "token_budget": token_budget,
        "pd_route": pd_route,
        "pd_prompt_tokens": pd_prompt_tokens,
        "pd_output_tokens": pd_output_tokens,
        "pd_backlog_slack": pd_backlog_slack,
        "routing": routing,
        "cache_slack": cache_slack,
    }
    if advice is not None and policies is None:
        fail("--advice goes with --policies advised")
    base = preset_policies(policies, advice).to_dict() if policies is not None else {}
    changes = base | {k: v for k, v in given.items() if v is not None}
    if not changes:
        fail(
            "nothing to set: give --policies NAME or at least one of --prefill --sched-batch --chunk --predictor"
            " --dispatch --decode --reserve-point --colocated-schedule --queue-order --aging --ttft-target"
            " --ttft-miss --token-budget --pd-route --routing …"
        )

    async def body(c: TetriClient) -> dict[str, Any]:
        return await c.set_policies(changes)

    def render(d: dict[str, Any]) -> None:
        out.print(f"version {d['version']}; changed: {', '.join(d['changed']) or 'nothing'}")

    daemon.call(body, render)


@app.command("history")
@daemon_command
def history(daemon: Daemon) -> None:
    """The audit table: every policy change, oldest first."""

    async def body(c: TetriClient) -> list[dict[str, Any]]:
        return await c.policy_history()

    def render(rows: list[dict[str, Any]]) -> None:
        table(
            "policy changes",
            ("when", "field", "from", "to", "by"),
            [
                (
                    time.strftime("%H:%M:%S", time.localtime(r["ts"])),
                    r["field"],
                    r["old_value"],
                    r["new_value"],
                    r["requested_by"],
                )
                for r in rows
            ],
        )

    daemon.call(body, render, lambda rows: {"changes": rows})
