"""A worker process: an engine, its gRPC service and its link to the daemon.

``python -m workers.main --role prefill --daemon 127.0.0.1:50051`` (or ``tetrictl worker start``).
Prints one JSON line ``{"event": "ready", ...}`` on stdout once serving and registered.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from tetri import eventloop
from tetri.clock import ScaledClock
from tetri.config import WorkerSettings
from tetri.gcheap import freeze_startup_heap
from tetri.logsetup import configure_logging
from tetri.naming import served_name
from tetri.proto import rpc
from tetri.proto.peers import Peers
from tetri.proto.security import PortInUse, Tls, make_server

from .control import ControlLink, RegistrationRefused
from .engines.base import Engine
from .service import WorkerService

log = logging.getLogger("tetri.worker")


BUILTIN_BYTES = "builtin:bytes"  # the sim's tokenizer, as the daemon knows it (RegisterRequest.tokenizer)


def build_engine(settings: WorkerSettings, instance_id: str) -> Engine:
    """The engine, named as clients will ask for it, with the tokenizer the daemon will use for it."""
    engine = _engine(settings, instance_id)
    engine.model_name = served_name(settings.engine, settings.model, settings.served_model_name)
    if settings.engine == "sim":
        engine.tokenizer = str(Path(settings.tokenizer).resolve()) if settings.tokenizer else BUILTIN_BYTES
    else:
        model_dir = Path(settings.model or ".").resolve()
        own = model_dir if (model_dir / "tokenizer.json").is_file() else None
        source = Path(settings.tokenizer).resolve() if settings.tokenizer else own
        engine.tokenizer = str(source) if source else ""
    return engine


def tokenizer_vocab(directory: str) -> int:
    """How many ids a tokenizer directory knows (its tokenizer.json)."""
    from tokenizers import Tokenizer

    path = Path(directory) / "tokenizer.json"
    try:
        return int(Tokenizer.from_file(str(path)).get_vocab_size())
    except Exception as e:  # tokenizers raises its own Exception type
        raise ValueError(f"tokenizer: cannot load {path}: {e}") from None


def _engine(settings: WorkerSettings, instance_id: str) -> Engine:
    if settings.engine == "sim":
        from tetri.costmodel import load_profile

        from .engines.sim import SimEngine

        path = Path(settings.profiles_file) if settings.profiles_file else None
        profile = load_profile(settings.profile, path)
        vocab = tokenizer_vocab(settings.tokenizer) if settings.tokenizer else None
        return SimEngine(profile, settings.role, instance_id, ScaledClock(settings.time_scale), vocab_size=vocab)
    if settings.engine == "vllm":
        from .engines.vllm.engine import VllmEngine, VllmOptions  # vllm loads only here

        if not settings.model:
            raise ValueError("--engine vllm needs --model DIR (a local Hugging Face model directory)")
        opts = VllmOptions(
            model=settings.model,
            connector=settings.kv_connector,
            kv_store=settings.kv_store,
            kv_lease_s=settings.kv_lease_s,
            kv_both=settings.kv_both,
            on_missing_kv=settings.on_missing_kv,
            kv_wait_s=settings.kv_wait_s,
            chunk_size=settings.chunk_size,
            max_model_len=settings.max_model_len,
            block_size=settings.block_size,
            max_num_seqs=settings.max_num_seqs,
            scheduling_policy=settings.scheduling_policy,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            tensor_parallel_size=settings.tensor_parallel_size,
            load_format=settings.load_format,
            dtype=settings.dtype,
            idle_spin_s=settings.idle_spin_s,
            engine_cpus=settings.engine_cpus,
        )
        return VllmEngine(opts, settings.role, instance_id)
    raise ValueError(f"unknown engine {settings.engine!r}")


async def serve(settings: WorkerSettings, stop: asyncio.Event | None = None) -> int:
    stop = stop or asyncio.Event()
    tls = Tls(settings.tls_cert_file, settings.tls_key_file, settings.tls_ca_file)
    try:  # every call to this worker must carry the cluster token (tetri.proto.security)
        server, port = make_server(f"{settings.host}:{settings.port}", settings.token, tls)
        address = advertised_address(settings, port)
    except (PortInUse, ValueError, OSError) as e:  # OSError: no route to the daemon's host to advertise on
        print(
            json.dumps({"event": "error", "error": f"{type(e).__name__}: {e}" if isinstance(e, OSError) else str(e)}),
            flush=True,
        )
        return 2
    instance_id = settings.instance_id or default_instance_id(address)
    try:
        engine = build_engine(settings, instance_id)
    except ValueError as e:
        print(json.dumps({"event": "error", "error": str(e)}), flush=True)
        return 2
    peers = Peers(settings.token, tls)

    def engine_for(role: str) -> Engine:  # instance flip: the same engine settings in another role
        return build_engine(settings.model_copy(update={"role": role}), instance_id)

    service = WorkerService(engine, settings.role, instance_id, peers, settings.token, engine_factory=engine_for)
    rpc.add_WorkerServicer_to_server(service, server)
    await engine.start()
    await server.start()
    freeze_startup_heap()
    clock = ScaledClock(settings.time_scale)
    link = ControlLink(service, settings.daemon, address, settings.token, now=clock.now, tls=tls)
    link_task = asyncio.create_task(link.run())
    reg = asyncio.create_task(link.registered.wait())
    done, _ = await asyncio.wait({link_task, reg}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if link_task in done:
        reg.cancel()
        exc = link_task.exception()
        msg = f"registration refused: {exc}" if isinstance(exc, RegistrationRefused) else f"daemon link failed: {exc}"
        print(json.dumps({"event": "error", "error": msg}), flush=True)
        code = 1
    else:
        print(
            json.dumps(
                {
                    "event": "ready",
                    "instance_id": instance_id,
                    "role": settings.role,
                    "address": address,
                    "pid": os.getpid(),
                    "event_loop": eventloop.running(),
                }
            ),
            flush=True,
        )
        log.info("%s instance %s serving on %s", settings.role, instance_id, address)
        stopper = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({link_task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if link_task in done and isinstance(link_task.exception(), RegistrationRefused):
            code = 1
        stopper.cancel()
    link.stop()
    link_task.cancel()
    with contextlib.suppress(BaseException):
        await link_task
    await server.stop(grace=1.0)
    await service.close()
    await engine.stop()
    await peers.close()
    log.info("stopped")
    return code


def advertised_address(settings: WorkerSettings, port: int) -> str:
    """host:port the daemon and peers reach this worker at: `advertise` if set; else the bind address;
    for a wildcard bind (0.0.0.0, ::) the address this host uses to reach the daemon, never the wildcard."""
    if settings.advertise:
        host, _, p = settings.advertise.rpartition(":")
        if not host or not p.isdigit() or host in WILDCARDS:
            raise ValueError(f"advertise: {settings.advertise!r} is not a routable host:port")
        return settings.advertise
    if settings.host not in WILDCARDS:
        return f"{settings.host}:{port}"
    daemon_host = settings.daemon.rpartition(":")[0].strip("[]") or "127.0.0.1"
    family = socket.AF_INET6 if ":" in daemon_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:  # no packet is sent: it only picks a route
        s.connect((daemon_host, 9))
        local = s.getsockname()[0]
    return f"[{local}]:{port}" if ":" in local else f"{local}:{port}"


WILDCARDS = ("0.0.0.0", "::", "[::]", "")


def default_instance_id(address: str) -> str:
    """An id that does not name a role (an instance flips; its id stays): `worker-<port>` on loopback,
    `worker-<host>-<port>` otherwise, so workers on two hosts with the same port do not collide."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if host in ("localhost", "::1") or host.startswith("127."):
        return f"worker-{port}"
    return f"worker-{host.replace(':', '-')}-{port}"


def run(settings: WorkerSettings) -> int:
    try:
        configure_logging(settings.log_level, settings.log_file, settings.log_format, f"worker:{settings.role}")
    except OSError as e:
        print(f"error: [worker] log_file: cannot open {settings.log_file}: {e.strerror}", file=sys.stderr)
        return 2

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if settings.instances == 1:
            return await serve(settings, stop)
        # several sim instances on one event loop: each its own port, id, engine and daemon link
        ports = [0 if settings.port == 0 else settings.port + i for i in range(settings.instances)]
        codes = await asyncio.gather(*(serve(settings.model_copy(update={"port": p}), stop) for p in ports))
        return max(codes)

    return eventloop.run(main())


if __name__ == "__main__":
    import argparse

    from tetri.children import die_with_parent
    from tetri.config import ConfigError, load_worker_settings

    die_with_parent()

    ap = argparse.ArgumentParser(description="Run one Tetri worker.")
    for flag in ("role", "engine", "profile", "instance-id", "host", "daemon", "token", "model", "kv-connector"):
        ap.add_argument(f"--{flag}")
    for flag in ("kv-store", "on-missing-kv", "profiles-file", "dtype", "served-model-name", "tokenizer"):
        ap.add_argument(f"--{flag}")
    for flag in ("engine-cpus", "log-level", "log-file", "log-format", "scheduling-policy"):
        ap.add_argument(f"--{flag}")
    ap.add_argument("--kv-both", action="store_true", default=None)
    for flag in ("chunk-size", "max-model-len", "block-size", "max-num-seqs", "tensor-parallel-size"):
        ap.add_argument(f"--{flag}", type=int)
    ap.add_argument("--gpu-memory-utilization", type=float)
    ap.add_argument("--load-format")
    ap.add_argument("--kv-wait-s", type=float)
    ap.add_argument("--kv-lease-s", type=float)
    ap.add_argument("--idle-spin-s", type=float)
    ap.add_argument("--port", type=int)
    ap.add_argument("--instances", type=int)
    ap.add_argument("--advertise")
    for flag in ("tls-cert-file", "tls-key-file", "tls-ca-file"):
        ap.add_argument(f"--{flag}")
    ap.add_argument("--time-scale", type=float)
    ap.add_argument("--config")
    a = ap.parse_args()
    try:
        s = load_worker_settings(
            None if a.config is None else Path(a.config),
            role=a.role,
            engine=a.engine,
            profile=a.profile,
            instance_id=a.instance_id,
            host=a.host,
            daemon=a.daemon,
            token=a.token,
            port=a.port,
            instances=a.instances,
            advertise=a.advertise,
            tls_cert_file=a.tls_cert_file,
            tls_key_file=a.tls_key_file,
            tls_ca_file=a.tls_ca_file,
            time_scale=a.time_scale,
            model=a.model,
            kv_connector=a.kv_connector,
            kv_store=a.kv_store,
            profiles_file=a.profiles_file,
            dtype=a.dtype,
            served_model_name=a.served_model_name,
            tokenizer=a.tokenizer,
            kv_both=a.kv_both,
            on_missing_kv=a.on_missing_kv,
            kv_wait_s=a.kv_wait_s,
            kv_lease_s=a.kv_lease_s,
            idle_spin_s=a.idle_spin_s,
            engine_cpus=a.engine_cpus,
            chunk_size=a.chunk_size,
            max_model_len=a.max_model_len,
            block_size=a.block_size,
            max_num_seqs=a.max_num_seqs,
            tensor_parallel_size=a.tensor_parallel_size,
            gpu_memory_utilization=a.gpu_memory_utilization,
            load_format=a.load_format,
            scheduling_policy=a.scheduling_policy,
            log_level=a.log_level,
            log_file=a.log_file,
            log_format=a.log_format,
        )
        eventloop.chosen()  # a bad TETRI_EVENT_LOOP: one line, exit 2
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    raise SystemExit(run(s))
