"""The host agent's server: ``HostAgent`` on a Unix socket in a private folder, on its own loop in a thread."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
from pathlib import Path

import grpc

from paramplane.agent_lane import LANE_NAME, RankLanes
from paramplane.coordinator.server import add_servicer
from paramplane.host_agent import HostAgent
from paramplane.node.coord_client import MAX_MESSAGE_BYTES, CoordinatorClient
from paramplane.protos.auth import TokenAuthInterceptor

UPSTREAM_CALL_S = 10.0
"""Deadline of the agent's unary calls to the coordinator (host heartbeats, relayed calls without their own)."""


class AgentThread:
    """A running host agent for ``num_local`` ranks of host ``host_id``, in front of ``coordinator``."""

    def __init__(
        self,
        coordinator: str,
        *,
        host_id: str,
        num_local: int,
        token: str | None,
        tls_root_cert: bytes | None = None,
    ) -> None:
        if num_local < 1:
            raise ValueError(f"num_local must be >= 1, got {num_local}")
        self._args = (coordinator, host_id, num_local, token, tls_root_cert)
        self._folder = tempfile.mkdtemp(prefix="paramplane-agent-")  # mode 0700: only this user's ranks
        self.address = f"unix:{Path(self._folder) / 'agent.sock'}"
        """Where the ranks call (``PARAMPLANE_AGENT``)."""
        self.lane_path = str(Path(self._folder) / LANE_NAME)
        """The rank lane beside it (``agent_lane.py``): the ranks' clients find it there."""
        self.agent: HostAgent | None = None
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="paramplane-agent", daemon=True)

    def start(self, timeout_s: float = 30.0) -> str:
        """Serve; answers the address for ``PARAMPLANE_AGENT``."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"the host agent did not start within {timeout_s} s")
        if self._error is not None:
            raise OSError(f"the host agent did not start: {self._error}") from self._error
        return self.address

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        coordinator, host_id, num_local, token, root = self._args
        try:
            upstream = CoordinatorClient(
                coordinator, token=token, tls_root_cert=root, call_timeout_s=UPSTREAM_CALL_S
            )
            agent = HostAgent(upstream, host_id=host_id, num_local=num_local)
            options = [
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ]
            server = grpc.aio.server(interceptors=[TokenAuthInterceptor(token)], options=options)
            add_servicer(agent, server, agent.num_calls)
            if server.add_insecure_port(self.address) == 0:
                raise OSError(f"cannot bind {self.address}")
            await server.start()
            lanes = RankLanes(agent, token)
            await lanes.start(self.lane_path)
            agent.start()
            self.agent = agent
            self._stop = asyncio.Event()
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await lanes.stop()
            await server.stop(0.5)
            await agent.stop()

    def rank_died(self, pid: int, how: str, timeout_s: float = 5.0) -> None:
        """Tell the coordinator (through the agent) that rank process ``pid`` ended with a failure: its rank is
        named lost at once. Thread-safe; returns once the coordinator has it, or after ``timeout_s``."""
        agent = self.agent
        if agent is None or self._loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(agent.rank_died(pid, how), self._loop).result(timeout_s)
        except Exception:  # the coordinator's heartbeat timeout still names the rank
            pass

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving and remove the socket's folder."""
        if self._stop is not None and not self._loop.is_closed():
            with_loop = self._loop
            try:
                with_loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:
                pass  # the loop ended already
        self._thread.join(timeout_s)
        shutil.rmtree(self._folder, ignore_errors=True)
