"""gRPC channels to other processes, cached by address, with the bearer token attached."""

from __future__ import annotations

import grpc

from . import rpc


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


class Peers:
    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = grpc.aio.insecure_channel(address, options=[("grpc.enable_retries", 0)])
            self._channels[address] = ch
        return ch

    def worker(self, address: str) -> rpc.WorkerStub:
        return rpc.WorkerStub(self.channel(address))

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
