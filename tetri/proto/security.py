"""Who may call a cluster's gRPC services, and over what: the cluster token on every call (checked in
constant time by a server interceptor) and optional TLS.

Every gRPC server (the daemon's ControlPlane, each worker's Worker service) is built by `make_server`,
so no call is served without the token; every channel is opened by `open_channel`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

UNAUTHENTICATED_MESSAGE = "bad or missing cluster token"


@dataclass(frozen=True)
class Tls:
    """PEM files: this process's certificate and key (servers), the CA that signed its peers'."""

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.ca_file or self.cert_file)

    def server_credentials(self) -> grpc.ServerCredentials:
        if not (self.cert_file and self.key_file):
            raise ValueError("TLS needs tls_cert_file and tls_key_file to serve")
        return grpc.ssl_server_credentials([(_read(self.key_file), _read(self.cert_file))])

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=_read(self.ca_file) if self.ca_file else None)


NO_TLS = Tls()


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def token_ok(expected: str | None, presented: str | None) -> bool:
    """Constant-time comparison of a bearer token; no expected token accepts anything."""
    if not expected:
        return True
    return presented is not None and hmac.compare_digest(presented.encode(), expected.encode())


def bearer(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[7:]
    return None


def _denied(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that refuses the call with UNAUTHENTICATED."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
        yield None  # pragma: no cover - abort raises

    # A call that streams its requests is refused once its first request is in (or after a second): a
    # refusal that beats the client's first write makes grpc.aio fail that write and report the call as
    # INTERNAL ("Failed execute_batch") instead of UNAUTHENTICATED, once in a while.
    async def unary_in(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        await _first_request(requests)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    async def streaming_in(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await _first_request(requests)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
        yield None  # pragma: no cover - abort raises

    ser, deser = handler.response_serializer, handler.request_deserializer
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, deser, ser)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, deser, ser)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary_in, deser, ser)
    return grpc.stream_stream_rpc_method_handler(streaming_in, deser, ser)


async def _first_request(requests: AsyncIterator[Any], wait_s: float = 1.0) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(anext(aiter(requests)), wait_s)


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses every call that does not carry the cluster token (no token configured: all pass)."""

    def __init__(self, token: str | None) -> None:
        self.token = token

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or token_ok(self.token, bearer(details.invocation_metadata)):
            return handler
        return _denied(handler)


# A worker that stops answering (frozen, partitioned) is noticed within about keepalive time + timeout,
# even on a stream with no traffic; servers allow pings that often.
CHANNEL_OPTIONS = [
    ("grpc.enable_retries", 0),
    ("grpc.keepalive_time_ms", 5000),
    ("grpc.keepalive_timeout_ms", 5000),
    ("grpc.http2.ping_timeout_ms", 5000),  # newer gRPC cores wait this long (default 60 s) for the ping's ack
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # a peer that restarts (a controller, a worker) is reached again within about 2 s, not gRPC's
    # default backoff that grows to 2 minutes
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),  # a port in use is an error, never a second listener on it
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 4000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_ping_strikes", 0),
]


def open_channel(address: str, tls: Tls = NO_TLS) -> grpc.aio.Channel:
    """A channel with keepalive (and TLS when configured); calls pass the token as metadata
    (`tetri.proto.peers`)."""
    if tls.enabled:
        return grpc.aio.secure_channel(address, tls.channel_credentials(), CHANNEL_OPTIONS)
    return grpc.aio.insecure_channel(address, CHANNEL_OPTIONS)


class PortInUse(RuntimeError):
    pass


def make_server(address: str, token: str | None, tls: Tls = NO_TLS) -> tuple[grpc.aio.Server, int]:
    """A gRPC server bound to `address` (port 0: any free port) that checks the token on every call.
    Raises `PortInUse` naming the address when it cannot bind."""
    server = grpc.aio.server(interceptors=[TokenCheck(token)], options=SERVER_OPTIONS)
    try:
        if tls.enabled:
            port = server.add_secure_port(address, tls.server_credentials())
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if port == 0:
        raise PortInUse(f"cannot listen on {address} (in use, or not an address of this host)")
    return server, port
