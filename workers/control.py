"""The worker's link to the daemon: register, then report load every interval on a bidirectional
stream and receive the daemon's decode-load broadcast in return. Reconnects with back-off."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Callable

import grpc

from tetri.proto import pb, rpc
from tetri.proto.peers import auth_metadata
from tetri.proto.security import NO_TLS, Tls, open_channel

from .service import WorkerService

log = logging.getLogger(__name__)


class RegistrationRefused(RuntimeError):
    pass


class ControlLink:
    def __init__(
        self,
        service: WorkerService,
        daemon: str,
        address: str,
        token: str | None,
        now: Callable[[], float] | None = None,
        tls: Tls = NO_TLS,
    ) -> None:
        self.tls = tls
        self.service = service
        self.daemon = daemon
        self.address = address
        self.token = token
        self.interval = 0.1
        self.registered = asyncio.Event()
        self._now = now or (lambda: 0.0)
        self._stop = asyncio.Event()

    async def register(self, stub: rpc.ControlPlaneStub) -> None:
        u = self.service.engine.usage()
        reply = await stub.Register(
            pb.RegisterRequest(
                instance_id=self.service.instance_id,
                role=self.service.role,
                address=self.address,
                model=self.service.engine.model_name,
                max_model_len=self.service.engine.max_model_len,
                kv_capacity_tokens=u.kv_capacity_tokens,
                vocab_size=self.service.engine.vocab_size,
                tokenizer=self.service.engine.tokenizer,
                block_size=self.service.engine.block_size,
            ),
            metadata=auth_metadata(self.token),
            timeout=5,
        )
        if not reply.accepted:
            raise RegistrationRefused(reply.reason)
        self.interval = reply.report_interval_s or self.interval

    async def _reports(self) -> AsyncIterator[pb.LoadReport]:
        # the first report at once, the second after a random part of an interval: instances that
        # registered together (a worker process hosting several, a cluster starting) do not report in step
        wait = random.uniform(0.0, self.interval)
        self.service.cache_stream(random.getrandbits(63))  # a new stream: the daemon relearns the whole cache
        while not self._stop.is_set():
            yield self.service.load_report(self._now(), cache=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), wait)
            wait = self.interval

    async def run(self) -> None:
        """Stay connected until stopped. A refused registration ends the worker (RegistrationRefused)."""
        backoff = 0.1
        async with open_channel(self.daemon, self.tls) as channel:
            stub = rpc.ControlPlaneStub(channel)
            while not self._stop.is_set():
                try:
                    await self.register(stub)
                    self.registered.set()
                    backoff = 0.1
                    call = stub.ReportLoad(self._reports(), metadata=auth_metadata(self.token))
                    async for msg in call:
                        self.service.on_broadcast(msg)
                except RegistrationRefused:
                    raise
                except grpc.aio.AioRpcError as e:
                    if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                        raise RegistrationRefused(e.details() or e.code().name) from None
                    log.info("daemon link lost (%s); retrying in %.1fs", e.code().name, backoff)
                if self._stop.is_set():
                    break
                self.registered.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), backoff)
                backoff = min(2.0, backoff * 2)

    def stop(self) -> None:
        self._stop.set()
