"""`tetrictl policy show|set|history`: the runtime scheduling policies (hot-swap) over the admin API."""

import inspect
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
from .console import Daemon, daemon_command, option, with_options
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


def _flag(field: str, flag: str, kind: type, help: str) -> tuple[str, str, inspect.Parameter]:
    """A policy field's option of `policy set`: the field it sets, its flag, and the option (None: leave it)."""
    name = flag.removeprefix("--").replace("-", "_")
    return field, flag, option(name, Annotated[kind | None, typer.Option(flag, help=help)])


# each policy field `policy set` changes, its flag and its help, once
_FIELDS = (
    _flag("prefill_policy", "--prefill", str, f"Prefill order: {_choices(PREFILL_POLICIES)}."),
    _flag("prefill_sched_batch", "--sched-batch", int, "PrefillSchedBatch (≥ 1)."),
    _flag("chunk_size", "--chunk", int, "ChunkSize, tokens per prefill iteration (≥ 1)."),
    _flag("predictor", "--predictor", str, f"{_choices(PREDICTORS)}."),
    _flag("predictor_accuracy", "--accuracy", float, "Oracle predictor accuracy (0–1)."),
    _flag("predictor_granularity", "--granularity", int, "Predictor bucket, tokens."),
    _flag("dispatch", "--dispatch", str, f"{_choices(DISPATCH_POLICIES)}."),
    _flag("decode_admission", "--decode", str, f"Decode admission: {_choices(ADMISSION_POLICIES)}."),
    _flag(
        "reserve_point",
        "--reserve-point",
        str,
        f"Point of a predicted bucket reserve policies count: {_choices(RESERVE_POINTS)}.",
    ),
    _flag(
        "colocated_schedule",
        "--colocated-schedule",
        str,
        f"How colocated instances schedule: {_choices(COLOCATED_SCHEDULES)}.",
    ),
    _flag(
        "queue_order",
        "--queue-order",
        str,
        f"The order decode and colocated instances admit waiting requests in: {_choices(QUEUE_ORDERS)} "
        "(srpt: least predicted work first, with aging).",
    ),
    _flag(
        "aging_admissions",
        "--aging",
        int,
        "srpt: a request waiting while this many others are admitted goes first (≥ 1).",
    ),
    _flag(
        "ttft_target_s",
        "--ttft-target",
        float,
        "Colocated: seconds; a request waiting longer goes after those that can still meet it (0: off).",
    ),
    _flag(
        "ttft_miss",
        "--ttft-miss",
        str,
        f"A request past --ttft-target goes {_choices(TTFT_MISSES)} (last, colocated: after those that "
        "can still meet it; reject, colocated and prefill instances: answered 429 with Retry-After, recorded "
        "rejected).",
    ),
    _flag(
        "token_budget",
        "--token-budget",
        int,
        "Colocated vllm-v1: tokens an iteration while no prompt has waited half its --ttft-target "
        "(fewer prompt tokens beside the decodes: lower TPOT); 0: the engine's max_num_batched_tokens.",
    ),
    _flag(
        "pd_route",
        "--pd-route",
        str,
        f"Where the model has colocated and prefill/decode instances, each request runs colocated or "
        f"split by: {_choices(PD_ROUTES)} (role: colocated; split: split; length: split the prompts of "
        "--pd-prompt-tokens or more and, with --pd-output-tokens, the long predicted outputs, unless that path "
        "is backed up).",
    ),
    _flag("pd_prompt_tokens", "--pd-prompt-tokens", int, "--pd-route length: prompts this long run split (≥ 1)."),
    _flag(
        "pd_output_tokens",
        "--pd-output-tokens",
        int,
        "--pd-route length: and requests predicted to produce this many tokens (the upper end of the "
        "length predictor's range; 0 or --predictor none: not considered).",
    ),
    _flag(
        "pd_backlog_slack",
        "--pd-backlog-slack",
        int,
        "--pd-route length: the other path when the chosen one has more than this many more requests "
        "waiting (0: the length alone decides).",
    ),
    _flag(
        "routing",
        "--routing",
        str,
        "The entry instance: cache-aware (the one holding most of the prompt in its prefix cache, within "
        "--cache-slack of the least loaded), least-load, or round-robin.",
    ),
    _flag(
        "cache_slack",
        "--cache-slack",
        int,
        "--routing cache-aware: an instance holding the prompt's prefix is chosen only while it has at most "
        "this many more requests waiting or running than the least loaded.",
    ),
)
_FIELD_OF = {p.name: field for field, _, p in _FIELDS}


def _set(daemon: Daemon, policies: PresetOpt = None, advice: AdviceOpt = None, *, fields: dict[str, Any]) -> None:
    """Change policies; the daemon validates them together (a bad value: exit 2 naming the field),
    applies them without restart and records each change in the audit table. --policies NAME sets every
    field to that named set first; the other flags change fields of it."""
    if advice is not None and policies is None:
        fail("--advice goes with --policies advised")
    base = preset_policies(policies, advice).to_dict() if policies is not None else {}
    changes = base | {k: v for k, v in fields.items() if v is not None}
    if not changes:
        fail(f"nothing to set: give --policies NAME or at least one of {' '.join(f for _, f, _ in _FIELDS)}")

    async def body(c: TetriClient) -> dict[str, Any]:
        return await c.set_policies(changes)

    def render(d: dict[str, Any]) -> None:
        out.print(f"version {d['version']}; changed: {', '.join(d['changed']) or 'nothing'}")

    daemon.call(body, render)


set_ = app.command("set")(
    daemon_command(
        with_options(
            _set,
            tuple(p for _, _, p in _FIELDS),
            lambda own, flags: _set(**own, fields={_FIELD_OF[k]: v for k, v in flags.items()}),
            given="fields",
        )
    )
)


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
