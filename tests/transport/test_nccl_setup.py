"""NCCL set-up that needs no GPU: the unique id through the key/value store, GPU sharing per host."""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest
from _world import run_world

from paramplane.node.topology import RankInfo, Topology
from paramplane.node.transports.nccl import pack_unique_id, share_gpu_env, unpack_unique_id


@pytest.mark.parametrize(
    "uid", [tuple(range(-64, 64)), tuple(range(128, 256)), tuple([0] * 128), bytes(range(128, 256))]
)
def test_unique_id_round_trips(uid: bytes | tuple[int, ...]) -> None:
    raw = pack_unique_id(uid)
    assert len(raw) == 129
    assert unpack_unique_id(raw) == uid


def test_malformed_unique_id_is_refused() -> None:
    with pytest.raises(ValueError, match="128 bytes"):
        pack_unique_id((1, 2, 3))
    with pytest.raises(ValueError, match="malformed"):
        unpack_unique_id(b"\x00" * 128)
    with pytest.raises(ValueError, match="malformed"):
        unpack_unique_id(b"\x07" + b"\x00" * 128)


def _topology(hosts: list[str]) -> Topology:
    node_of = {h: i for i, h in enumerate(dict.fromkeys(hosts))}
    seen: dict[str, int] = {}
    ranks = []
    for r, h in enumerate(hosts):
        ranks.append(RankInfo(r, f"127.0.0.1:{5000 + r}", h, node_of[h], seen.get(h, 0)))
        seen[h] = seen.get(h, 0) + 1
    return Topology(tuple(ranks))


def test_ranks_sharing_a_gpu_get_distinct_nccl_host_ids() -> None:
    topo = _topology(["a", "a"])
    envs = [{}, {}]
    assert all(share_gpu_env(topo, r, num_devices=1, environ=envs[r]) for r in range(2))
    assert envs[0]["NCCL_HOSTID"] != envs[1]["NCCL_HOSTID"]
    assert all(e["NCCL_SOCKET_IFNAME"] == "lo" for e in envs)


def test_gpu_sharing_leaves_enough_devices_and_user_settings_alone() -> None:
    env: dict[str, str] = {}
    assert not share_gpu_env(_topology(["a", "a"]), 0, num_devices=2, environ=env)
    assert env == {}
    env = {"NCCL_HOSTID": "mine"}
    assert not share_gpu_env(_topology(["a", "a"]), 1, num_devices=1, environ=env)
    assert env == {"NCCL_HOSTID": "mine"}


def test_gpu_sharing_across_hosts_keeps_the_socket_interface_open() -> None:
    env: dict[str, str] = {}
    assert share_gpu_env(_topology(["a", "a", "b", "b"]), 2, num_devices=1, environ=env)
    assert env["NCCL_HOSTID"].startswith("b")
    assert "NCCL_SOCKET_IFNAME" not in env


class FakeNcclError(RuntimeError):
    pass


FAKE_NCCL = types.SimpleNamespace(
    NcclError=FakeNcclError, NCCL_FLOAT32=7, NCCL_SUM=0, NCCL_PROD=1, NCCL_MIN=2, NCCL_MAX=3
)


class _FailingComm:
    """Stands for a cupy NcclCommunicator whose calls and async-error check fail."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def allReduce(self, *args: object) -> None:
        self.calls.append("allReduce")
        raise FakeNcclError("NCCL_ERROR_REMOTE_ERROR: remote process exited")

    def check_async_error(self) -> None:
        raise FakeNcclError("NCCL_ERROR_SYSTEM_ERROR: unhandled system error")


def test_nccl_errors_become_typed_device_comm_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    from paramplane.node import transports
    from paramplane.node.errors import DeviceCommError, TransportError
    from paramplane.node.spec import OpSpec

    monkeypatch.setattr(transports.nccl, "_nccl", lambda: FAKE_NCCL)
    monkeypatch.setattr(transports.nccl.NcclComm, "_stream", staticmethod(lambda: 0))
    fake = _FailingComm()
    comm = transports.nccl.NcclComm(fake, 2)
    flat = types.SimpleNamespace(data=types.SimpleNamespace(ptr=0), size=4, dtype=np.dtype(np.float32))
    with pytest.raises(DeviceCommError, match=r"NCCL allReduce failed in op 3 of group .g..*REMOTE_ERROR"):
        comm.all_reduce(OpSpec("g", 3, "all_reduce", "float32", (4,)), flat, "sum", 0.0)
    assert fake.calls == ["allReduce"]
    error = comm.async_error()
    assert isinstance(error, DeviceCommError) and isinstance(error, TransportError)
    assert "SYSTEM_ERROR" in str(error)
    healthy = transports.nccl.NcclComm(types.SimpleNamespace(check_async_error=lambda: None), 2)
    assert healthy.async_error() is None
    # Once aborted, the communicator is neither aborted again nor polled (NCCL would see a freed handle).
    aborts: list[int] = []
    fake.abort = lambda: aborts.append(1)  # type: ignore[attr-defined]
    comm.abort()
    comm.abort()
    assert aborts == [1] and comm.async_error() is None


def test_an_nccl_async_error_aborts_the_world_on_every_rank() -> None:
    """Rank 0's communicator reports an asynchronous error; the runtime's poll finds it and aborts the world:
    both ranks, each waiting where only the coordinator can wake it, fail with the NCCL error named."""
    world = run_world(2, "nccl_async.py", timeout=60, heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0)
    for res in world.check_ok():
        assert "NCCL communicator error" in res["values"]["error"], res


def test_a_peer_dying_under_nccl_is_named_not_blamed_on_nccl() -> None:
    """NCCL reports a dead peer as a remote error before the coordinator's heartbeat timeout names the rank
    (seen on an H200). The rank that sees it waits for the coordinator's verdict, so its world aborts with
    PeerLost naming the dead rank, not with an NCCL error that blames itself."""
    world = run_world(
        2, "nccl_async.py", args=["peer_dies"], timeout=60, heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0
    )
    assert not world.timed_out, world.describe()
    assert world.ranks[1].returncode == -9, world.describe()
    r0 = world.ranks[0].result
    assert world.ranks[0].returncode == 0 and r0 is not None and r0["failures"] == [], world.describe()
    assert r0["values"]["error"].startswith("PeerLost") and r0["values"]["lost_rank"] == 1, r0["values"]


class _StandInNccl:
    """``cupy.cuda.nccl`` without a GPU: a fixed unique id, communicators that record what they were built
    from, and an init that can be told to block (a member that never joins)."""

    class NcclError(Exception):
        pass

    def __init__(self, block: bool = False) -> None:
        self.block = block
        self.built: list[tuple[int, tuple[int, ...], int]] = []
        self.released = threading.Event()

    def get_unique_id(self) -> tuple[int, ...]:
        return tuple((i * 7) % 256 - 128 for i in range(128))

    def NcclCommunicator(self, n: int, uid: tuple[int, ...], index: int) -> object:
        if self.block:
            self.released.wait(30)
        self.built.append((n, tuple(uid), index))
        return types.SimpleNamespace(n=n, index=index)


def _stand_in_cupy(monkeypatch: pytest.MonkeyPatch, nccl: _StandInNccl) -> None:
    import contextlib
    import sys

    from paramplane.node.transports import nccl as nccl_transport

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(Device=lambda _device: contextlib.nullcontext())  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(nccl_transport, "_nccl", lambda: nccl)


async def test_nccl_unique_id_goes_through_the_coordinator_and_init_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NcclComm.create on a real coordinator with a stand-in NCCL: the group's first member publishes the unique
    id in the key/value store and the other builds its communicator from the same id; a member whose peer never
    joins NCCL's init fails with CollectiveTimeout naming the group and its ranks within the timeout."""
    import asyncio

    from paramplane.coordinator.server import CoordinatorConfig, CoordinatorServer
    from paramplane.node.coord_client import CoordinatorClient
    from paramplane.node.errors import CollectiveTimeout
    from paramplane.node.transports.nccl import NcclComm

    nccl = _StandInNccl()
    _stand_in_cupy(monkeypatch, nccl)
    server = await CoordinatorServer.start(CoordinatorConfig(host="127.0.0.1", port=0, world_size=2))
    try:
        async with CoordinatorClient(server.address) as a, CoordinatorClient(server.address) as b:
            joins = [
                c.join(host_id="h", peer_address=f"127.0.0.1:{7000 + i}", instance_id=f"i{i}", timeout_s=10)
                for i, c in enumerate((a, b))
            ]
            members = await asyncio.wait_for(asyncio.gather(*joins), 20)
            first, second = (a, b) if members[0].rank == 0 else (b, a)
            # The second member asks first: it waits in the store until the first publishes.
            later = asyncio.ensure_future(NcclComm.create(second, "g", [0, 1], 1, 0, timeout_s=10))
            comms = [await asyncio.wait_for(NcclComm.create(first, "g", [0, 1], 0, 0, timeout_s=10), 20)]
            comms.append(await asyncio.wait_for(later, 20))
            uid = nccl.get_unique_id()
            assert sorted(nccl.built, key=lambda b: b[2]) == [(2, uid, 0), (2, uid, 1)]
            assert [c.size for c in comms] == [2, 2]

            nccl.block = True  # a member that never joins NCCL's init
            started = asyncio.get_running_loop().time()
            with pytest.raises(CollectiveTimeout, match=r"'h2'.*ranks \[0, 1\] never joined"):
                await NcclComm.create(first, "h2", [0, 1], 0, 0, timeout_s=1.0)
            # Its 1 s, with slack for busy cores.
            assert asyncio.get_running_loop().time() - started < 1.0 + 14.0
    finally:
        nccl.released.set()
        await server.stop(grace=0.1)
