"""The one configuration loader: a TOML file plus environment variables (pydantic-settings).

Precedence: explicit arguments (CLI flags) > environment (``TETRI_DAEMON_*``, ``TETRI_WORKER_*``) >
the TOML file (``--config``, or ``TETRI_CONFIG``; sections ``[daemon]`` and ``[worker]``) > defaults.
Every field is documented here and in docs/cluster.md.
"""

from __future__ import annotations

import ipaddress
import json
import os
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from .costmodel import DEFAULT_PROFILE, Profile, load_profile
from .scheduling.policyset import PolicyError, PolicySet

if TYPE_CHECKING:
    from .des.slo import SloSet

Role = Literal["prefill", "decode", "colocated"]


class ConfigError(ValueError):
    """The configuration file or a setting is invalid (one line for the user)."""


class DaemonSettings(BaseSettings):
    """The control-plane daemon."""

    model_config = SettingsConfigDict(env_prefix="TETRI_DAEMON_", extra="forbid")

    host: str = Field("127.0.0.1", description="HTTP bind address. Anything but loopback requires `token`.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (OpenAI API, admin API, /metrics); 0 = any.")
    grpc_host: str = Field("127.0.0.1", description="Bind address of the control-plane gRPC service.")
    grpc_port: int = Field(50051, ge=0, le=65535, description="Port of the control-plane gRPC service; 0 = any.")
    state_dir: Path = Field(Path("state"), description="Where the SQLite status tables live.")
    db_url: str | None = Field(None, description="Any SQLAlchemy URL; default sqlite:///<state_dir>/tetri.db.")
    token: str | None = Field(
        None,
        description="Bearer token for the admin API (identity `admin`) and, unless `cluster_token` is set, the "
        "cluster's gRPC calls (required off loopback).",
    )
    admin_tokens: dict[str, str] = Field(
        default_factory=dict,
        description='More admin API tokens, by name (`{ops = "…"}`): the name is the audit\'s `requested_by`.',
    )
    cluster_token: str | None = Field(
        None,
        description="Token every gRPC call in the cluster carries (registration, load reports, every worker "
        "RPC); default `token`. `tetrictl up` makes a random one per cluster.",
    )
    api_keys: list[str] = Field(
        default_factory=list, description="Accepted OpenAI API keys; empty = the OpenAI endpoint is open."
    )
    report_interval_s: float = Field(0.1, gt=0, description="How often workers report load (seconds).")
    unhealthy_after: int = Field(5, ge=1, description="Missed reports after which an instance is unhealthy.")
    load_retention_s: float = Field(600.0, gt=0, description="How long load samples are kept in the database.")
    load_sample_every: int = Field(10, ge=1, description="Store one load sample per instance every N reports.")
    flush_interval_s: float = Field(0.05, gt=0, description="Batched status-table writes: flush period.")
    store_buffer_rows: int = Field(
        100_000,
        ge=1,
        description="Status-table rows held in memory while the database is unavailable (a full disk, a server "
        "down), written when it is back; past this many, new requests get 503 (store_unavailable) and requests in "
        "flight finish, their rows held.",
    )
    predictor_retrain_s: float = Field(
        60.0, gt=0, description="Retrain the learned length predictor this often (when it is selected)."
    )
    time_scale: float = Field(
        1.0, gt=0, description="The cluster clock: model seconds per wall second (the sim workers' time_scale)."
    )
    max_request_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="Largest HTTP request body accepted; larger ones get 413."
    )
    http_header_timeout_s: float = Field(
        60.0,
        gt=0,
        description="A connection's request headers must arrive whole within this (nginx's "
        "client_header_timeout); else 408 and the connection closes.",
    )
    http_body_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Between two reads of a request body at most this passes (nginx's client_body_timeout); "
        "else 408 and the connection closes.",
    )
    drain_grace_s: float = Field(
        30.0, ge=0, description="SIGTERM: how long in-flight requests may run on before they are interrupted."
    )
    max_migrations: int = Field(
        3, ge=0, description="Times a request moves to another instance when the one serving it dies."
    )
    migration_wait_s: float = Field(
        30.0, ge=0, description="How long a migrating request waits for a healthy instance (wall seconds)."
    )
    entry_wait_s: float = Field(
        5.0,
        ge=0,
        description="How long a new request waits when its model's instances are registered but none can "
        "take it now (a late load report, a flip, a drain) before failing (wall seconds).",
    )
    dead_after_s: float = Field(
        10.0, gt=0, description="An instance silent this long (wall seconds) is removed from the registry."
    )
    stream_interval: int = Field(
        1,
        ge=1,
        description="Streamed answers: an SSE event per N tokens (the first token's at once, what is left with the "
        "end), as vLLM's --stream-interval: fewer socket writes per token, the same text; 1: every engine step.",
    )
    expect_models: list[str] = Field(
        default_factory=list,
        description="Models this cluster is starting (`tetrictl up` names the one its workers serve): until an "
        "instance of one registers, a request for it gets 503 with Retry-After, not 404 (a client that retries "
        "on 503 waits for it).",
    )
    front_connect_s: float = Field(
        30.0, gt=0, description="A front: how long it waits for the controller's first view before giving up."
    )
    resume_policies: bool = Field(
        False,
        description="Start with the policies last in force (the audit trail's), not the configured ones: a "
        "controller restarted after a crash (`--fronts` restarts it so).",
    )
    store_prompt_samples: bool = Field(
        False,
        description="Keep each prompt's first 256 token ids in the status table (the learned length "
        "predictor trains on them; shown by the admin API). Off: they are kept in memory only.",
    )
    tls_cert_file: str | None = Field(None, description="PEM certificate: serve HTTP and gRPC over TLS.")
    tls_key_file: str | None = Field(None, description="PEM private key of tls_cert_file.")
    tls_ca_file: str | None = Field(None, description="PEM CA bundle that signed the workers' certificates.")
    policies: dict[str, Any] = Field(
        default_factory=dict,
        description='The runtime policies the cluster starts with (`{colocated_schedule = "vllm-v1"}`; any '
        "field of `tetrictl policy show`); changed later with `tetrictl policy set`.",
    )
    profile: str | None = Field(
        None,
        description="Cost profile of the cluster's model and GPUs (tetri/profiles.toml, or profiles_file): what "
        "the `advise` flip policy simulates; without one that policy is refused. `tetrictl up` passes its own.",
    )
    profiles_file: str | None = Field(
        None, description="Read `profile` from this file (`tetrictl profile` writes one)."
    )
    slo: list[str] = Field(
        default_factory=list,
        description="The SLOs the `advise` flip policy scores splits against: 'ttft=1,tpot=0.1' (the default) "
        "and per class 'HPLD:ttft=5' (seconds; as `tetrictl advise --slo`).",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("warning", description="Least level logged.")
    log_file: str | None = Field(None, description="Append the log here (default: stderr).")
    log_format: Literal["text", "json"] = Field("text", description="text lines, or one JSON object a line.")

    def grpc_token(self) -> str | None:
        return self.cluster_token or self.token

    def database_url(self) -> str:
        return self.db_url or f"sqlite:///{(self.state_dir / 'tetri.db').as_posix()}"

    def needs_token(self) -> bool:
        return not is_loopback(self.host) or not is_loopback(self.grpc_host)


class WorkerSettings(BaseSettings):
    """One prefill, decode or colocated worker."""

    model_config = SettingsConfigDict(env_prefix="TETRI_WORKER_", extra="forbid")

    role: Role = Field("prefill", description="prefill, decode or colocated.")
    engine: Literal["sim", "vllm"] = Field("sim", description="Compute engine: sim, or vllm (the optional extra).")
    profile: str = Field(DEFAULT_PROFILE, description="Sim engine profile (tetri/profiles.toml).")
    profiles_file: str | None = Field(
        None, description="Sim engine: a profiles file to read the profile from (e.g. `tetrictl profile`'s)."
    )
    time_scale: float = Field(1.0, gt=0, description="Sim engine: model seconds per wall second.")
    instances: int = Field(
        1,
        ge=1,
        le=1024,
        description="Sim engine: instances this process hosts, each its own gRPC port and registration (scale "
        "tests: many instances on little hardware); their ports are port, port+1, … (or any free ones for 0).",
    )
    model: str | None = Field(None, description="vllm: a local Hugging Face model directory.")
    served_model_name: str | None = Field(
        None,
        max_length=128,
        description="The model name clients send (`model`); default: the model directory's name (vllm), "
        "tetri-sim (sim).",
    )
    tokenizer: str | None = Field(
        None,
        description="A local Hugging Face tokenizer directory the daemon loads for this model; default: the "
        "model directory (vllm), the built-in byte tokenizer (sim). With a sim engine, its token ids stay "
        "within that tokenizer's vocabulary.",
    )
    kv_connector: Literal["HostKVConnector", "NixlConnector"] = Field(
        "HostKVConnector", description="vllm: the KV connector (docs/vllm.md)."
    )
    kv_store: str = Field(
        "/dev/shm/tetri-kv", description="vllm + HostKVConnector: the KV storage path both engines share (a tmpfs)."
    )
    kv_lease_s: float = Field(
        60.0, gt=0, description="vllm + HostKVConnector: a hand-over no decode engine loaded within this is removed."
    )
    kv_both: bool = Field(False, description="vllm: connector role kv_both, so a flip keeps the engine.")
    on_missing_kv: Literal["error", "recompute"] = Field(
        "error", description="vllm decode: a hand-over whose KV never arrives fails, or recomputes the prompt."
    )
    kv_wait_s: float = Field(5.0, gt=0, description="vllm decode: how long to wait for handed-over KV.")
    chunk_size: int = Field(512, ge=16, description="vllm: max_num_batched_tokens (ChunkSize, chunked prefill on).")
    max_model_len: int | None = Field(None, ge=16, description="vllm: context length (default: the model's).")
    block_size: int | None = Field(None, ge=1, description="vllm: KV block size (default: the platform's).")
    max_num_seqs: int = Field(64, ge=1, description="vllm: most sequences in a batch.")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs",
        description="vllm: vLLM's scheduling policy; priority lets a colocated engine take queue_order srpt.",
    )
    idle_spin_s: float | None = Field(
        None,
        ge=0,
        description="vllm: how long the engine's idle processes busy-wait for the next message before they park "
        "(vLLM's own: 1 s); default 0.005 for prefill, and for decode without engine_cpus (they must not spin "
        "on cores others need); vLLM's for decode with cores of its own and for colocated.",
    )
    engine_cpus: str | None = Field(
        None,
        pattern=r"^\d+(-\d+)?(,\d+(-\d+)?)*$",
        description="vllm: the CPU cores (e.g. `0`, `2-5,8`) the engine's processes run on, its compute threads "
        "bound to them (VLLM_CPU_OMP_THREADS_BIND unless set); default: anywhere, vLLM's own binding. Engines "
        "sharing a host get disjoint cores (docs/vllm.md).",
    )
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="vllm on GPUs: memory share to use.")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="vllm on GPUs: GPUs one engine spans.")
    load_format: Literal["auto", "dummy"] = Field(
        "auto", description="vllm: auto (the model's weights), or dummy (random weights: config.json alone)."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="vllm: weight and KV dtype (auto: the model's)."
    )
    instance_id: str | None = Field(
        None, description="Instance id; default worker-<port> (worker-<host>-<port> off loopback)."
    )
    host: str = Field("127.0.0.1", description="Bind address of the worker's gRPC service.")
    port: int = Field(0, ge=0, le=65535, description="Port of the worker's gRPC service; 0 = any free port.")
    daemon: str = Field("127.0.0.1:50051", description="host:port of the daemon's control-plane gRPC service.")
    token: str | None = Field(
        None, description="The cluster token: presented on every call, required of every call to this worker."
    )
    advertise: str | None = Field(
        None,
        description="host:port the daemon and peers reach this worker at; default the bound address, or for "
        "a wildcard bind the address this host uses to reach the daemon (never 0.0.0.0).",
    )
    tls_cert_file: str | None = Field(None, description="PEM certificate: serve the Worker service over TLS.")
    tls_key_file: str | None = Field(None, description="PEM private key of tls_cert_file.")
    tls_ca_file: str | None = Field(None, description="PEM CA bundle for the daemon's and peers' certificates.")
    log_level: Literal["debug", "info", "warning", "error"] = Field("warning", description="Least level logged.")
    log_file: str | None = Field(None, description="Append the log here (default: stderr).")
    log_format: Literal["text", "json"] = Field("text", description="text lines, or one JSON object a line.")


ExtraField = tuple[str, Any, str]  # (name, default or None, description)


def example_toml(extra: dict[str, list[ExtraField]] | None = None) -> str:
    """A commented TOML file of every setting of the `[daemon]` and `[worker]` sections (and `extra`
    sections, e.g. the CLI's `[ctl]`), each with its description and default, generated from the settings
    models so that it cannot drift from them. Every setting is commented out: the file, as written, changes
    nothing; a setting without a default is shown as a comment only."""
    lines = [
        "# Tetri configuration (`tetrictl config example`): every setting, its meaning and its default.",
        "# Uncomment what you change. Precedence: flags > environment (TETRI_DAEMON_*, TETRI_WORKER_*) > this",
        "# file (--config, or TETRI_CONFIG) > defaults. docs/cluster.md lists them too.",
    ]
    sections: list[tuple[str, str, list[ExtraField]]] = []
    for name, model in (("daemon", DaemonSettings), ("worker", WorkerSettings)):
        fields = []
        for key, f in model.model_fields.items():
            default = f.get_default(call_default_factory=True)
            fields.append((key, default, f.description or ""))
        sections.append((name, (model.__doc__ or "").strip(), fields))
    for name, fields in (extra or {}).items():
        sections.append((name, "", fields))
    for name, doc, fields in sections:
        lines += ["", f"[{name}]"] + ([f"# {doc}"] if doc else [])
        for key, default, description in fields:
            lines += ["", *[f"# {line}" for line in _wrap(description)]]
            lines.append(f"# {key} = {_toml_value(default)}" if default is not None else f"# {key} =  (no default)")
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, Path):
        return json.dumps(v.as_posix())
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {v!r}")


def _wrap(text: str, width: int = 100) -> list[str]:
    out: list[str] = []
    for word in text.split():
        if out and len(out[-1]) + 1 + len(word) <= width:
            out[-1] += " " + word
        else:
            out.append(word)
    return out


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _section(path: Path | None, name: str) -> dict[str, Any]:
    path = path or (Path(os.environ["TETRI_CONFIG"]) if os.environ.get("TETRI_CONFIG") else None)
    if path is None:
        return {}
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config {path}: {e}") from None
    section = data.get(name, {})
    if not isinstance(section, dict):
        raise ConfigError(f"config {path}: [{name}] must be a table")
    return section


def _build(cls: type[BaseSettings], path: Path | None, name: str, overrides: dict[str, Any]) -> Any:
    base = _section(path, name)
    prefix = str(cls.model_config["env_prefix"])
    env_keys = {k[len(prefix) :].lower() for k in os.environ if k.upper().startswith(prefix)}
    merged = {k: v for k, v in base.items() if k not in env_keys}  # the environment beats the file
    merged.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return cls(**merged)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or name
        raise ConfigError(f"[{name}] {where}: {err['msg']}") from None


def load_daemon_settings(path: Path | None = None, **overrides: Any) -> DaemonSettings:
    s: DaemonSettings = _build(DaemonSettings, path, "daemon", overrides)
    check_daemon_settings(s)
    return s


def check_daemon_settings(s: DaemonSettings) -> None:
    """What the fields' own types do not check: a token off loopback, the starting policies, the profile
    and SLOs (ConfigError, one line naming the field)."""
    if s.needs_token() and not s.token:
        raise ConfigError("daemon bound off loopback needs a token (--token or TETRI_DAEMON_TOKEN)")
    if start_policies(s).flip_policy == "advise" and s.profile is None:
        raise ConfigError("[daemon] policies.flip_policy: advise needs the cluster's cost profile (--profile)")
    advisor_inputs(s)


def advisor_inputs(s: DaemonSettings) -> tuple[Profile, SloSet] | None:
    """The `advise` flip policy's inputs for this daemon: its cost profile and SLOs (None without a profile;
    the daemon builds the advisor from them); ConfigError names a bad one."""
    if s.profile is None:
        return None
    from .des.slo import parse_slos
    from .des.workloads import WorkloadSpecError

    try:
        profile = load_profile(s.profile, Path(s.profiles_file) if s.profiles_file else None)
    except (ValueError, OSError) as e:
        raise ConfigError(f"[daemon] profile: {e}") from None
    try:
        return profile, parse_slos(s.slo)
    except WorkloadSpecError as e:
        raise ConfigError(f"[daemon] slo: {e}") from None


def start_policies(s: DaemonSettings) -> PolicySet:
    """The policies the daemon starts with (`policies` over the defaults); ConfigError names a bad field."""
    try:
        return PolicySet().changed(**s.policies)
    except PolicyError as e:
        raise ConfigError(f"[daemon] policies.{e}") from None


def load_worker_settings(path: Path | None = None, **overrides: Any) -> WorkerSettings:
    s: WorkerSettings = _build(WorkerSettings, path, "worker", overrides)
    if s.engine == "vllm" and not s.model:
        raise ConfigError("[worker] model: --engine vllm needs a local Hugging Face model directory (--model DIR)")
    if s.instances > 1 and s.engine != "sim":
        raise ConfigError("[worker] instances: only sim engines share a process (--engine sim)")
    if s.instances > 1 and (s.instance_id or s.advertise):
        raise ConfigError("[worker] instances: several instances take their ids and addresses from their ports")
    return s
