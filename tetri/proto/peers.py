"""gRPC channels to other processes, cached by address (TLS when the cluster has it:
`tetri.proto.security`). Every call passes `metadata=peers.metadata`: the cluster token, which every
server of the cluster requires. (Metadata per call, not a client interceptor: grpc.aio's intercepted
streaming calls cost the control plane about a tenth of its throughput.)"""

from __future__ import annotations

import grpc

from . import rpc
from .security import NO_TLS, Tls, open_channel


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


class Peers:
    def __init__(self, token: str | None = None, tls: Tls = NO_TLS) -> None:
        self.token = token
        self.metadata = auth_metadata(token)
        self.tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = open_channel(address, self.tls)
            self._channels[address] = ch
        return ch

    def worker(self, address: str) -> rpc.WorkerStub:
        return rpc.WorkerStub(self.channel(address))

    def control(self, address: str) -> rpc.ControlPlaneStub:
        return rpc.ControlPlaneStub(self.channel(address))

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
