"""`tetrictl up`, `tetrictl daemon start`, `tetrictl worker start`: run the cluster's processes."""

import fcntl
import os
import signal
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from tetri.costmodel import DEFAULT_PROFILE
from tetri.logsetup import FORMATS as LOG_FORMATS
from tetri.logsetup import LEVELS as LOG_LEVELS
from tetri.naming import served_name
from tetri.scheduling.colocated import BASELINES
from tetri.scheduling.policyset import PolicySet
from tetri.scheduling.presets import DEFAULT_PRESET

from . import exitcodes
from .console import ProfileOpt, option, profile_help, with_options
from .output import fail, out, print_json
from .policy_cmd import AdviceOpt, PresetOpt, preset_policies
from .procs import LocalCluster, StartError, start_local_cluster

ConfigOpt = Annotated[Path | None, typer.Option("--config", help="TOML config file ([daemon], [worker]).")]
StateDirOpt = Annotated[Path | None, typer.Option(help="Directory of the SQLite status tables.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the ready report as one JSON document.")]

daemon_app = typer.Typer(help="The control-plane daemon.", no_args_is_help=True, rich_markup_mode=None)
worker_app = typer.Typer(help="Prefill/decode workers.", no_args_is_help=True, rich_markup_mode=None)
front_app = typer.Typer(
    help="Fronts: API-serving processes that follow a controller.", no_args_is_help=True, rich_markup_mode=None
)


def _exec(module: str, args: list[str]) -> None:
    """Replace this process with the daemon or worker (signals and exit code pass straight through)."""
    os.execv(sys.executable, [sys.executable, "-m", module, *args])


LogLevelOpt = Annotated[str | None, typer.Option(help="Log level: debug, info, warning (default) or error.")]
LogFileOpt = Annotated[Path | None, typer.Option(help="Append the log to this file (default: stderr).")]
StreamIntervalOpt = Annotated[
    int | None,
    typer.Option(
        help="Streamed answers: an SSE event per N tokens, the first at once (as vLLM's --stream-interval; "
        "default 1: every engine step). Fewer socket writes per token, the same text."
    ),
]
LogFormatOpt = Annotated[str | None, typer.Option(help="Log format: text (default) or json, one object a line.")]
EngineOpt = Annotated[str, typer.Option(help="Engine: sim, or vllm (needs the vllm extra).")]
ModelOpt = Annotated[str | None, typer.Option(help="vllm: a local Hugging Face model directory.")]
ServedNameOpt = Annotated[
    str | None,
    typer.Option(help="The model name clients send (default: the model directory's name; sim: tetri-sim)."),
]
KvConnectorOpt = Annotated[
    str | None, typer.Option(help="vllm: HostKVConnector (default, one host) or NixlConnector (GPUs).")
]
MaxModelLenOpt = Annotated[int | None, typer.Option(help="vllm: context length.")]
DtypeOpt = Annotated[str | None, typer.Option(help="vllm: auto, float32, bfloat16 or float16.")]
MaxNumSeqsOpt = Annotated[int | None, typer.Option(help="vllm: most sequences in a batch (default 64).")]
GpuMemOpt = Annotated[float | None, typer.Option(help="vllm on GPUs: the share of GPU memory to use (default 0.9).")]
TensorParallelOpt = Annotated[int | None, typer.Option(help="vllm on GPUs: GPUs one engine spans (default 1).")]
LoadFormatOpt = Annotated[
    str | None, typer.Option(help="vllm: auto (the model's weights) or dummy (random weights, config.json alone).")
]
ChunkSizeOpt = Annotated[int | None, typer.Option(help="vllm: max_num_batched_tokens (ChunkSize).")]


def _flags(values: dict[str, Any]) -> list[str]:
    """Options as the process's own command line spells them: `--name-with-dashes VALUE` for each given
    (not None), a bare `--name` for a true flag, nothing for a false one."""
    args: list[str] = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is not None and value is not False:
            args += [flag, str(value)]
    return args


# what every process `tetrictl … start` runs takes, declared once
_PROCESS_OPTIONS = (
    option(
        "token",
        Annotated[
            str | None,
            typer.Option(
                help="The daemon's and a front's bearer token; a worker's cluster token, on every call to and "
                "from it (required off loopback)."
            ),
        ],
    ),
    option("config", ConfigOpt),
    option("log_level", LogLevelOpt),
    option("log_file", LogFileOpt),
    option("log_format", LogFormatOpt),
)


def process_command(module: str, *fixed: str) -> Callable[[Callable[..., list[str]]], Callable[..., None]]:
    """`tetrictl daemon|front|worker start`: the command runs `module` in the foreground with its options as
    flags (`_flags`), after the arguments `fn` returns for the options named in `fixed` (it checks them)."""

    def deco(fn: Callable[..., list[str]]) -> Callable[..., None]:
        def run(own: dict[str, Any], shared: dict[str, Any]) -> None:
            lead = fn(**own)
            _exec(module, lead + _flags({k: v for k, v in own.items() if k not in fixed} | shared))

        return with_options(fn, _PROCESS_OPTIONS, run)

    return deco


@daemon_app.command("start")
@process_command("daemon.main")
def daemon_start(
    host: Annotated[str | None, typer.Option(help="HTTP bind address (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port (default 8000).")] = None,
    grpc_port: Annotated[int | None, typer.Option(help="Control-plane gRPC port (default 50051).")] = None,
    grpc_host: Annotated[
        str | None, typer.Option(help="Control-plane gRPC bind address (default 127.0.0.1; 0.0.0.0: remote workers).")
    ] = None,
    state_dir: StateDirOpt = None,
    db_url: Annotated[str | None, typer.Option(help="Any SQLAlchemy URL instead of the state dir.")] = None,
    time_scale: Annotated[
        float | None, typer.Option(help="The cluster clock: model seconds per wall second (the sim workers').")
    ] = None,
    fronts: Annotated[
        int | None,
        typer.Option(
            help="Run a controller and N fronts that share the HTTP port (SO_REUSEPORT), each kept running "
            "(docs/cluster.md, 'Fronts and a controller')."
        ),
    ] = None,
    stream_interval: StreamIntervalOpt = None,
) -> list[str]:
    """Run the daemon in the foreground (prints a JSON ready line)."""
    if fronts is not None and fronts < 1:
        fail("--fronts must be at least 1")
    return []


@front_app.command("start")
@process_command("daemon.main", "controller", "name", "front_port")
def front_start(
    controller: Annotated[str, typer.Option(help="The controller's gRPC address, HOST:PORT.")],
    name: Annotated[str, typer.Option(help="The front's name (its status rows carry NAME.PID.RANDOM).")] = "front",
    host: Annotated[str | None, typer.Option(help="HTTP bind address (default 127.0.0.1).")] = None,
    port: Annotated[
        int | None, typer.Option(help="HTTP port, shared with the host's other fronts (default 8000).")
    ] = None,
    front_port: Annotated[int, typer.Option(help="A port of this front's own besides --port (0: any).")] = 0,
    state_dir: StateDirOpt = None,
    db_url: Annotated[
        str | None, typer.Option(help="The controller's database (PostgreSQL for fronts on several hosts).")
    ] = None,
    stream_interval: StreamIntervalOpt = None,
) -> list[str]:
    """Run one front in the foreground, following the controller at --controller (prints a JSON ready line
    once it has the controller's view)."""
    return ["--role", "front", "--controller", controller, "--front-name", name, "--front-port", str(front_port)]


@worker_app.command("start")
@process_command("workers.main", "role", "daemon", "engine")
def worker_start(
    role: Annotated[str, typer.Option(help="prefill, decode or colocated.")],
    daemon: Annotated[str, typer.Option(help="The daemon's control-plane gRPC address host:port.")] = "127.0.0.1:50051",
    engine: EngineOpt = "sim",
    model: ModelOpt = None,
    served_model_name: ServedNameOpt = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(help="A local tokenizer directory for the daemon (default: the model's; sim: built-in bytes)."),
    ] = None,
    kv_connector: KvConnectorOpt = None,
    kv_store: Annotated[
        str | None, typer.Option(help="vllm + HostKVConnector: the KV path both engines share (a tmpfs).")
    ] = None,
    kv_lease_s: Annotated[
        float | None, typer.Option(help="vllm + HostKVConnector: remove hand-overs not loaded within this (60).")
    ] = None,
    kv_both: Annotated[bool, typer.Option("--kv-both", help="vllm: kv_both connector role (flips in place).")] = False,
    on_missing_kv: Annotated[str | None, typer.Option(help="vllm decode: error or recompute.")] = None,
    chunk_size: ChunkSizeOpt = None,
    scheduling_policy: Annotated[
        str | None,
        typer.Option(help="vllm: fcfs (vLLM's default) or priority (colocated: takes --queue-order srpt)."),
    ] = None,
    max_model_len: MaxModelLenOpt = None,
    block_size: Annotated[int | None, typer.Option(help="vllm: KV block size.")] = None,
    dtype: DtypeOpt = None,
    max_num_seqs: MaxNumSeqsOpt = None,
    gpu_memory_utilization: GpuMemOpt = None,
    tensor_parallel_size: TensorParallelOpt = None,
    load_format: LoadFormatOpt = None,
    engine_cpus: Annotated[
        str | None, typer.Option(help="vllm: the cores the engine's processes run on, e.g. 0 or 2-5,8 (default: any).")
    ] = None,
    profile: Annotated[str | None, typer.Option(help=profile_help("Sim: the engine's cost-model profile"))] = None,
    profiles_file: Annotated[
        Path | None, typer.Option(help="Sim: read the profile from this file (tetrictl profile writes one).")
    ] = None,
    time_scale: Annotated[float | None, typer.Option(help="Sim: model seconds per wall second.")] = None,
    host: Annotated[str | None, typer.Option(help="Bind address of the worker's gRPC service.")] = None,
    port: Annotated[int | None, typer.Option(help="Port of the worker's gRPC service (0 = any).")] = None,
    instance_id: Annotated[str | None, typer.Option(help="Instance id (default worker-<port>).")] = None,
    advertise: Annotated[
        str | None, typer.Option(help="host:port others reach this worker at (default: a routable bind address).")
    ] = None,
) -> list[str]:
    """Run one worker in the foreground; it registers with the daemon (prints a JSON ready line)."""
    return ["--role", role, "--daemon", daemon, "--engine", engine]


def up(
    mode: Annotated[
        str,
        typer.Option(
            help="disaggregated (prefill + decode), colocated (vanilla baseline) or hybrid (colocated + prefill + "
            "decode, each request split or not by its prompt's length: pd_route length)."
        ),
    ] = "disaggregated",
    prefill: Annotated[int, typer.Option(help="Prefill instances (disaggregated, hybrid).")] = 1,
    decode: Annotated[int, typer.Option(help="Decode instances (disaggregated, hybrid).")] = 1,
    colocated: Annotated[int, typer.Option(help="Colocated instances (colocated, hybrid).")] = 2,
    baseline: Annotated[
        str | None,
        typer.Option(
            help="Colocated and hybrid modes: schedule the colocated instances as vllm-v0 (prefill-first, padded "
            "prompt batches) or "
            "vllm-v1 (chunked prefill mixed into decode batches); default: the --policies set's (vllm-v1 for "
            "vllm-v1, prefill-first for tetriinfer; docs/scheduling.md)."
        ),
    ] = None,
    policies: PresetOpt = DEFAULT_PRESET,
    advice: AdviceOpt = None,
    engine: EngineOpt = "sim",
    model: ModelOpt = None,
    served_model_name: ServedNameOpt = None,
    kv_connector: KvConnectorOpt = None,
    chunk_size: ChunkSizeOpt = None,
    max_model_len: MaxModelLenOpt = None,
    dtype: DtypeOpt = None,
    max_num_seqs: MaxNumSeqsOpt = None,
    gpu_memory_utilization: GpuMemOpt = None,
    tensor_parallel_size: TensorParallelOpt = None,
    load_format: LoadFormatOpt = None,
    profile: ProfileOpt = DEFAULT_PROFILE,
    time_scale: Annotated[
        float, typer.Option(help="Sim: model seconds per wall second (the workers' and the daemon's clock).")
    ] = 1.0,
    port: Annotated[int, typer.Option(help="Daemon HTTP port (0 = any free port).")] = 8000,
    grpc_port: Annotated[int, typer.Option(help="Daemon gRPC port (0 = any free port).")] = 50051,
    fronts: Annotated[
        int,
        typer.Option(
            help="0: one daemon process. N: a controller and N fronts sharing the HTTP port, each restarted "
            "when it dies (docs/cluster.md, 'Fronts and a controller')."
        ),
    ] = 0,
    stream_interval: StreamIntervalOpt = None,
    state_dir: Annotated[Path, typer.Option(help="Directory of the SQLite status tables.")] = Path("state"),
    config: ConfigOpt = None,
    log_level: LogLevelOpt = None,
    log_file: Annotated[Path | None, typer.Option(help="Append every process's log to this file.")] = None,
    log_format: LogFormatOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Bring up a cluster on this host: the daemon plus sim workers, or vLLM workers over a local model
    (--engine vllm --model DIR); a worker that exits is restarted. Ctrl-C, SIGTERM or tetrictl down stops
    everything, the daemon first: it drains its in-flight requests."""
    if mode not in ("disaggregated", "colocated", "hybrid"):
        fail(f"--mode must be disaggregated, colocated or hybrid, not {mode!r}")
    if engine not in ("sim", "vllm"):
        fail(f"--engine must be sim or vllm, not {engine!r}")
    vllm_only: dict[str, object] = {
        "--model": model,
        "--kv-connector": kv_connector,
        "--chunk-size": chunk_size,
        "--max-model-len": max_model_len,
        "--dtype": dtype,
        "--max-num-seqs": max_num_seqs,
        "--gpu-memory-utilization": gpu_memory_utilization,
        "--tensor-parallel-size": tensor_parallel_size,
        "--load-format": load_format,
    }
    if engine == "sim":
        given = [flag for flag, v in vllm_only.items() if v is not None]
        if given:
            fail(f"{given[0]} applies to --engine vllm")
    elif model is None:
        fail("--engine vllm needs --model DIR (a local Hugging Face model directory)")
    elif time_scale != 1.0:
        fail("--time-scale applies to the sim engine; vLLM runs in real time")
    preset = preset_policies(policies or DEFAULT_PRESET, advice)
    baseline = baseline.strip().lower() if baseline is not None else None
    if baseline is not None and baseline not in BASELINES:
        fail(f"--baseline must be one of {', '.join(BASELINES)}, not {baseline!r}")
    if baseline is not None and mode == "disaggregated":
        fail("--baseline schedules colocated instances: use it with --mode colocated or hybrid")
    if log_level is not None and log_level not in LOG_LEVELS:
        fail(f"--log-level must be one of {', '.join(LOG_LEVELS)}, not {log_level!r}")
    if log_format is not None and log_format not in LOG_FORMATS:
        fail(f"--log-format must be one of {', '.join(LOG_FORMATS)}, not {log_format!r}")
    log_args = _flags({"log_level": log_level, "log_file": log_file, "log_format": log_format})
    counts = {"prefill": prefill, "decode": decode} if mode == "disaggregated" else {"colocated": colocated}
    if mode == "hybrid":
        counts = {"colocated": colocated, "prefill": prefill, "decode": decode}
    for role, n in counts.items():
        if n < 1:
            fail(f"--{role} must be at least 1")
    if fronts < 0:
        fail("--fronts must be 0 (one daemon process) or more")
    if stream_interval is not None and stream_interval < 1:
        fail(f"--stream-interval must be at least 1, not {stream_interval}")
    stopping = {"flag": False, "starting": True}

    def on_signal(signum: int, frame: object) -> None:
        stopping["flag"] = True
        if stopping["starting"]:  # out of the start (what started is stopped): tetrictl down works from the first
            raise _StopWhileStarting

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    roles = [role for role, n in counts.items() for _ in range(n)]
    wargs = ["--engine", engine]
    for flag, value in (*vllm_only.items(), ("--served-model-name", served_model_name)):
        wargs += _flags({flag.removeprefix("--").replace("-", "_"): value})
    # the preset's fields that are not the defaults, but none the config file's [daemon] policies set: the
    # preset is the base, the operator's file adjusts it, --baseline and --mode hybrid come last
    configured = _configured_policies(config)
    start_policies = {k: v for k, v in preset.to_dict().items() if v != DEFAULTS[k] and k not in configured}
    if baseline:
        start_policies["colocated_schedule"] = baseline
    if mode == "hybrid" and preset.pd_route == "role":
        start_policies["pd_route"] = "length"
    pidfile = state_dir / UP_PIDFILE
    lock = _lock_up(state_dir)
    if lock is None:
        fail(f"a cluster from {state_dir} is up already (pid in {pidfile}); tetrictl down stops it", exitcodes.REFUSED)
    try:
        code = _serve(
            roles, state_dir, profile, time_scale, mode, port, grpc_port, config, start_policies, log_args, fronts,
            stream_interval, wargs, engine, baseline, policies, json_out, stopping,
            served_name(engine, model, served_model_name),
        )  # fmt: skip
    finally:
        pidfile.unlink(missing_ok=True)  # ours: we hold its lock
        os.close(lock)
    raise typer.Exit(code)


class _StopWhileStarting(Exception):
    """SIGTERM or Ctrl-C while `up` starts its processes."""


def _serve(
    roles: list[str],
    state_dir: Path,
    profile: str,
    time_scale: float,
    mode: str,
    port: int,
    grpc_port: int,
    config: Path | None,
    start_policies: dict[str, Any],
    log_args: list[str],
    fronts: int,
    stream_interval: int | None,
    wargs: list[str],
    engine: str,
    baseline: str | None,
    policies: str | None,
    json_out: bool,
    stopping: dict[str, bool],
    model_name: str,
) -> int:
    """Start the cluster, serve until a signal, stop it; the exit code. `model_name`: what clients send for
    the workers' model (the daemon answers 503 for it, not 404, until they register)."""
    try:
        cluster = start_local_cluster(
            roles,
            state_dir=state_dir,
            profile=profile,
            time_scale=time_scale,
            mode=mode,
            port=port,
            grpc_port=grpc_port,
            config=config,
            policies=start_policies or None,
            log_args=log_args,
            fronts=fronts,
            stream_interval=stream_interval,
            worker_args=wargs,
            worker_timeout=VLLM_START_S if engine == "vllm" else 60.0,
            expect_models=[model_name],
        )
    except StartError as e:
        fail(str(e), exitcodes.REFUSED)
    except _StopWhileStarting:
        if not json_out:
            out.print("stopped while starting")
        return 0
    stopping["starting"] = False
    if stopping["flag"]:  # a signal between the start's end and here
        cluster.stop()
        return 0
    doc = {
        "url": cluster.url,
        "grpc": cluster.grpc,
        "mode": mode,
        "baseline": baseline,
        "policies": policies,
        "engine": engine,
        "workers": cluster.workers,
    }
    if fronts:
        doc |= {"controller": cluster.ready["controller"], "fronts": cluster.ready["fronts"]}
    if json_out:
        print_json(doc)
    else:
        out.print(
            f"Tetri is up at [bold]{cluster.url}[/] ({mode}{' as ' + baseline if baseline else ''}, "
            f"policies {policies}; "
            + ", ".join(f"{w['role']} {w['instance_id']}" for w in cluster.workers)
            + "). Ctrl-C or tetrictl down stops it."
        )
    sys.stdout.flush()
    code = _supervise(cluster, stopping)
    if not json_out:
        out.print("stopping: the daemon drains in-flight requests first, then the workers stop")
    cluster.stop()
    if not json_out:
        out.print("stopped")
    return code


def _supervise(cluster: LocalCluster, stopping: dict[str, bool]) -> int:
    """Until a signal: restart a worker that exits (too many restarts, or a daemon that exits, stop the
    cluster); the exit code."""
    code = 0
    restarts: list[float] = []
    while not stopping["flag"]:
        if cluster.procs[0].poll() is not None:
            out.print(f"[red]the daemon exited (code {cluster.procs[0].returncode}); stopping the cluster[/]")
            code = exitcodes.REFUSED
            break
        dead = [i for i, p in enumerate(cluster.procs) if i and p.poll() is not None]
        for i in dead:  # a worker died: start a replacement (the daemon migrates its requests meanwhile)
            restarts = [t for t in restarts if t > time.monotonic() - RESTART_WINDOW_S] + [time.monotonic()]
            if len(restarts) > MAX_RESTARTS:
                out.print(f"[red]{len(restarts)} worker restarts within {RESTART_WINDOW_S:.0f} s; stopping[/]")
                stopping["flag"], code = True, exitcodes.REFUSED
                break
            was, rc = cluster.workers[i - 1]["instance_id"], cluster.procs[i].returncode
            try:
                info = cluster.restart_worker(i)
            except StartError as e:
                out.print(f"[red]restarting {was} failed: {e}; stopping the cluster[/]")
                stopping["flag"], code = True, exitcodes.REFUSED
                break
            out.print(f"worker {was} exited (code {rc}); restarted as {info['instance_id']}")
        time.sleep(0.2)
    return code


UP_PIDFILE = "up.pid"  # in the state directory: the running `tetrictl up`'s pid, for `tetrictl down`
VLLM_START_S = 900.0  # a vLLM worker may take this long to load its model and report ready
DEFAULTS = PolicySet().to_dict()


def _configured_policies(config: Path | None) -> set[str]:
    """The policy fields the config file's [daemon] policies table sets (an unreadable file: none here; the
    daemon reports it)."""
    if config is None:
        return set()
    try:
        table = tomllib.loads(config.read_text(encoding="utf-8")).get("daemon", {}).get("policies", {})
    except (OSError, tomllib.TOMLDecodeError, AttributeError):
        return set()
    return set(table) if isinstance(table, dict) else set()


def _lock_up(state_dir: Path) -> int | None:
    """Take `state_dir`'s pid file for this `up`: an exclusive lock held while the process lives (the
    kernel drops it when the process dies, however it dies), the pid written in it. None: another `up`
    holds it. The fd is not inherited by the children."""
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / UP_PIDFILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def _running_up(pidfile: Path) -> int | None:
    """The pid of the `tetrictl up` that holds `pidfile`'s lock; None when none does (no file, or one left
    by an `up` that is gone: its pid may belong to another process by now, and is never signalled)."""
    try:
        fd = os.open(pidfile, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        for _ in range(40):
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # held: an `up` is running; its pid is written just after the lock
                text = os.pread(fd, 32, 0).decode().strip()
                if text.isdigit():
                    return int(text)
                time.sleep(0.05)
                continue
            return None
        return None
    finally:
        os.close(fd)


def down(
    state_dir: Annotated[
        Path, typer.Option(help="The state directory the cluster was started with (tetrictl up --state-dir).")
    ] = Path("state"),
    timeout: Annotated[float, typer.Option(help="Seconds to wait for it to stop (its drain included).")] = 60.0,
    json_out: Annotated[bool, typer.Option("--json", help="Print the result as one JSON document.")] = False,
) -> None:
    """Stop the cluster that tetrictl up runs from this state directory, from any terminal: SIGTERM to it, so
    the daemon drains its in-flight requests, then the workers stop; waits until it has exited."""
    pidfile = state_dir / UP_PIDFILE
    pid = _running_up(pidfile)
    if pid is None:
        fail(f"no cluster is up from {state_dir} (no live pid in {pidfile})", exitcodes.REFUSED)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _running_up(pidfile) == pid:
        if time.monotonic() > deadline:
            fail(f"tetrictl up (pid {pid}) did not stop within {timeout:.0f} s", exitcodes.REFUSED)
        time.sleep(0.1)
    if json_out:
        print_json({"stopped": pid, "state_dir": str(state_dir)})
    else:
        out.print(f"stopped tetrictl up (pid {pid})")


MAX_RESTARTS = 5  # worker restarts allowed within RESTART_WINDOW_S before `up` gives up
RESTART_WINDOW_S = 60.0
