"""Coordinator security, health, CLI and the client's error mapping (127.0.0.1, port 0 only)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from paramplane import AuthError, CoordinatorUnavailable, RendezvousError
from paramplane.coordinator.cli import main as coordinator_main
from paramplane.coordinator.server import CoordinatorConfig, CoordinatorServer, CoordinatorThread
from paramplane.node.coord_client import CoordinatorClient, Membership

T = TypeVar("T")
TOKEN = "s3cret-job-token"


async def within(seconds: float, aw: Awaitable[T]) -> T:
    return await asyncio.wait_for(aw, seconds)


def join(c: CoordinatorClient, instance: str = "inst-0", timeout_s: float = 5.0) -> Awaitable[Membership]:
    return c.join(host_id="h", peer_address="127.0.0.1:7000", instance_id=instance, timeout_s=timeout_s)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_token_is_required_and_checked() -> None:
    server = await CoordinatorServer.start(CoordinatorConfig(port=0, world_size=1, token=TOKEN))
    try:
        for token in (None, "wrong"):
            async with CoordinatorClient(server.address, token=token) as c:
                with pytest.raises(AuthError) as err:
                    await within(5, join(c))
                assert TOKEN not in str(err.value)
        async with CoordinatorClient(server.address, token=TOKEN) as c:
            assert (await within(5, join(c))).rank == 0
    finally:
        await server.stop(grace=0.1)


async def test_health_check_serves_without_a_token() -> None:
    server = await CoordinatorServer.start(CoordinatorConfig(port=0, world_size=1, token=TOKEN))
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", "paramplane.v1.Coordinator"):
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(grace=0.1)


async def test_closed_port_is_coordinator_unavailable_within_the_join_timeout() -> None:
    address = f"127.0.0.1:{closed_port()}"
    async with CoordinatorClient(address) as c:
        start = time.monotonic()
        with pytest.raises(
            CoordinatorUnavailable, match=f"cannot reach the coordinator at {address}: is it running?"
        ):
            await within(30, join(c, timeout_s=0.5))
        assert time.monotonic() - start < 15.0  # not the default join timeout (300 s)


async def test_join_waits_for_a_coordinator_that_starts_late() -> None:
    port = closed_port()
    async with CoordinatorClient(f"127.0.0.1:{port}") as c:
        joining = asyncio.create_task(join(c, timeout_s=10.0))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(joining), 0.3)  # still retrying: nothing listens yet
        server = await CoordinatorServer.start(CoordinatorConfig(port=port, world_size=1))
        try:
            assert (await within(5, joining)).world_size == 1
        finally:
            await server.stop(grace=0.1)


async def test_join_deadline_shorter_than_the_servers_is_a_rendezvous_error() -> None:
    server = await CoordinatorServer.start(CoordinatorConfig(port=0, world_size=2))
    try:
        async with CoordinatorClient(server.address) as c:
            with pytest.raises(
                RendezvousError, match=r"did not form within this rank's join timeout of 0\.3 s"
            ):
                await within(5, join(c, timeout_s=0.3))
            # the abandoned join was withdrawn: the same instance may join again
            async with CoordinatorClient(server.address) as other:
                ms = await within(5, asyncio.gather(join(c), join(other, "inst-1")))
                assert sorted(m.rank for m in ms) == [0, 1]
    finally:
        await server.stop(grace=0.1)


def test_config_refuses_bad_settings() -> None:
    with pytest.raises(ValueError, match=r"refusing to bind 0\.0\.0\.0 without a token; pass --token-file"):
        CoordinatorConfig(host="0.0.0.0", world_size=1)
    assert CoordinatorConfig(host="0.0.0.0", world_size=1, token="t").token == "t"
    assert "t0ken" not in repr(CoordinatorConfig(world_size=1, token="t0ken"))
    bad_settings = (
        {"world_size": 0},
        {"port": -1},
        {"tls_cert": b"x"},
        {"heartbeat_timeout_s": 0.5},
        {"host_lane_port": 65536},
    )
    for bad in bad_settings:
        with pytest.raises(ValueError):
            CoordinatorConfig(**{"world_size": 1, **bad})  # type: ignore[arg-type]


def test_cli_refuses_a_non_loopback_bind_without_token(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PARAMPLANE_TOKEN", raising=False)
    with pytest.raises(SystemExit) as exit_:
        coordinator_main(["--host", "0.0.0.0", "--port", "0", "--world-size", "1"])
    assert exit_.value.code == 2
    assert "refusing to bind 0.0.0.0 without a token" in capsys.readouterr().err


def test_thread_serves_and_a_second_bind_of_its_port_fails() -> None:
    with CoordinatorThread(CoordinatorConfig(port=0, world_size=1)) as coord:
        host, port = coord.address.rsplit(":", 1)
        assert host == "127.0.0.1"

        async def use() -> Membership:
            async with CoordinatorClient(coord.address) as c:
                return await within(5, join(c))

        assert asyncio.run(use()).rank == 0
        second = CoordinatorThread(CoordinatorConfig(port=int(port), world_size=1))
        with pytest.raises(OSError, match="cannot bind the coordinator"):
            second.start()


async def test_cli_serves_until_sigterm(tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    env = {**os.environ, "PARAMPLANE_TOKEN": TOKEN}
    args = ["-m", "paramplane.coordinator", "--port", "0", "--port-file", str(port_file), "--world-size", "1"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = (await within(20, proc.stdout.readline())).decode()
        port = int(port_file.read_text())
        assert line == f"paramplane coordinator listening on 127.0.0.1:{port} (world size 1)\n"
        async with CoordinatorClient(f"127.0.0.1:{port}", token=TOKEN) as c:
            assert (await within(5, join(c))).world_size == 1
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert await within(30, proc.wait()) == 0
        assert time.monotonic() - start < 20.0  # a bound with slack: it stops, it does not hang
        assert TOKEN not in (await proc.stderr.read()).decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await asyncio.wait_for(proc.wait(), 10)


async def test_tls_join_and_a_plaintext_client_is_refused(self_signed_cert: tuple[Path, Path]) -> None:
    cert, key = self_signed_cert
    config = CoordinatorConfig(port=0, world_size=1, tls_cert=cert.read_bytes(), tls_key=key.read_bytes())
    server = await CoordinatorServer.start(config)
    assert server.lanes is None  # the host lane is not encrypted: not served with TLS
    try:
        async with CoordinatorClient(server.address) as plain:
            with pytest.raises(CoordinatorUnavailable):
                await within(5, join(plain, timeout_s=0.5))
        async with CoordinatorClient(server.address, tls_root_cert=cert.read_bytes()) as c:
            assert (await within(5, join(c))).rank == 0
    finally:
        await server.stop(grace=0.1)


async def test_bad_addresses_and_timeouts_are_value_errors() -> None:
    for address in ("127.0.0.1", ":80", "127.0.0.1:port"):
        with pytest.raises(ValueError, match="must be HOST:PORT"):
            CoordinatorClient(address)
    with pytest.raises(ValueError, match="finite number of seconds > 0"):
        CoordinatorClient("127.0.0.1:1", call_timeout_s=0)
    async with CoordinatorClient(f"127.0.0.1:{closed_port()}") as c:
        for bad in (0.0, -1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="finite number of seconds > 0"):
                await within(5, join(c, timeout_s=bad))
        with pytest.raises(RendezvousError, match=r"not joined: call join\(\) before"):
            await c.kv_set("k", b"v")
