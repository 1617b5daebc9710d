"""The gRPC edge, front side: a front's subscription to its controller's view (`ControlPlane.Watch`,
daemon.controller.fronts). It follows every view, and keeps serving on the last one while the controller is away,
reconnecting."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable

import grpc

from tetri.proto import pb, rpc
from tetri.proto.peers import auth_metadata
from tetri.proto.security import NO_TLS, Tls, open_channel

from ..cluster import ClusterView
from ..wire import view_from_pb

log = logging.getLogger(__name__)


def front_incarnation(name: str) -> str:
    """The id a front's rows carry: its name, this process and a random part (a restarted front is a new
    incarnation, so ending the old one's rows never touches the new one's, even where pids repeat, as
    in containers). At most 64 characters (`requests.front`)."""
    return f"{name[:40]}.{os.getpid()}.{os.urandom(3).hex()}"


class ControllerUnreachable(RuntimeError):
    pass


class FrontLink:
    """A front's subscription to the controller's view. `first()` waits for the first view (a front
    starts serving only once it has one); `run()` follows every later one with `apply`, and when the
    stream breaks reconnects every `retry_s`, the front serving on the last view meanwhile."""

    def __init__(self, controller: str, front_id: str, token: str | None, tls: Tls = NO_TLS) -> None:
        self.controller = controller
        self.front_id = front_id
        self.metadata = auth_metadata(token)
        self.channel = open_channel(controller, tls)
        self.stub = rpc.ControlPlaneStub(self.channel)
        self.connected = False
        self.admin_url = ""  # the controller's HTTP API, as its last view said
        self.first_view: ClusterView | None = None  # the view `first` returned
        self._call: grpc.aio.UnaryStreamCall[pb.WatchRequest, pb.ClusterView] | None = None

    def _watch(self) -> grpc.aio.UnaryStreamCall[pb.WatchRequest, pb.ClusterView]:
        self._call = self.stub.Watch(pb.WatchRequest(front_id=self.front_id), metadata=self.metadata)
        return self._call

    async def first(self, timeout_s: float) -> ClusterView:
        """The controller's first view; `ControllerUnreachable` when none comes within `timeout_s`."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        why = "no answer"
        while (left := deadline - asyncio.get_running_loop().time()) > 0:
            call = self._watch()
            try:
                msg = await asyncio.wait_for(call.read(), left)
            except TimeoutError:
                call.cancel()
                break
            except grpc.aio.AioRpcError as e:
                if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    raise ControllerUnreachable(f"the controller at {self.controller} refused the token") from None
                why = e.code().name
                await asyncio.sleep(0.2)
                continue
            if msg is grpc.aio.EOF:
                continue
            self.connected = True
            self.first_view = self._took(view_from_pb(msg))
            return self.first_view
        raise ControllerUnreachable(f"no view from the controller at {self.controller} within {timeout_s:g} s ({why})")

    def _took(self, view: ClusterView) -> ClusterView:
        if view.admin_url:  # its port, on the host this front reaches the controller at (its own view of
            # its address may be 0.0.0.0 or loopback)
            scheme, _, rest = view.admin_url.partition("://")
            port = rest.rsplit(":", 1)[-1]
            self.admin_url = f"{scheme}://{self.controller.rsplit(':', 1)[0]}:{port}"
        return view

    async def run(self, apply: Callable[[ClusterView], Awaitable[None]], retry_s: float = 0.2) -> None:
        """Follow the views on the stream `first` opened, then on new ones, until cancelled."""
        call = self._call
        while True:
            try:
                if call is None:
                    call = self._watch()
                while (msg := await call.read()) is not grpc.aio.EOF:  # read(), as `first` began the stream
                    if not self.connected:
                        log.warning("the controller at %s is back: following its view again", self.controller)
                    self.connected = True
                    await apply(self._took(view_from_pb(msg)))
            except grpc.aio.AioRpcError as e:
                if self.connected:
                    log.warning(
                        "lost the controller at %s (%s): serving on its last view, reconnecting",
                        self.controller,
                        e.code().name,
                    )
            except Exception:  # a view this front cannot take: say so, and take the next one afresh
                log.exception("a view from the controller at %s could not be followed; reconnecting", self.controller)
                if call is not None:
                    call.cancel()
            self.connected, call = False, None
            await asyncio.sleep(retry_s)

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
        await self.channel.close()
