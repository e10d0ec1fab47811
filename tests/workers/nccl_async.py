"""An NCCL communicator's asynchronous error, found by the runtime's poll, aborts the world (no GPU needed:
rank 0's world group gets a stand-in communicator whose ``check_async_error`` raises).

``nccl_async.py peer_dies``: rank 1 is SIGKILLed as rank 0's communicator reports NCCL's remote error, what
a peer's death looks like on a GPU (its sockets close before the coordinator's heartbeat timeout): rank 0's
wait then fails with PeerLost naming rank 1, not with an NCCL error blaming rank 0."""

from __future__ import annotations

import os
import signal
import sys
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank

import paramplane as pp
from paramplane.node.errors import DeviceCommError
from paramplane.node.transports import nccl


class FakeNcclError(RuntimeError):
    pass


class _BrokenComm:
    def check_async_error(self) -> None:
        raise FakeNcclError("NCCL_ERROR_REMOTE_ERROR: a peer's proxy thread failed")

    def abort(self) -> None:
        pass


def scenario(world: Any, rep: Report) -> None:
    nccl._nccl = lambda: types.SimpleNamespace(NcclError=FakeNcclError)  # type: ignore[assignment]
    world.group.barrier()  # both ranks are up before the error
    peer_dies = sys.argv[1:] == ["peer_dies"]
    if peer_dies and world.rank == 1:
        rep.write()
        os.kill(os.getpid(), signal.SIGKILL)
    if world.rank == 0:
        world.group._e.transports.nccl = nccl.NcclComm(_BrokenComm(), 2)
    if peer_dies:
        # Nothing else runs here, so the runtime's first recorded cause is what its NCCL poll decided.
        rep.check("the world aborted", world._rt.aborted.wait(30))
        exc = world._rt.abort_error()
        rep.values["error"] = f"{type(exc).__name__}: {exc}"
        rep.values["lost_rank"] = exc.rank if isinstance(exc, pp.PeerLost) else None
        return
    try:
        world.barrier(f"only-rank-{world.rank}", timeout=45)  # no other rank ever arrives
        rep.check("the wait ended by the abort", False, "the barrier returned")
    except pp.PlaneError as exc:
        rep.values["error"] = f"{type(exc).__name__}: {exc}"
    if world.rank == 0:
        rep.raises("the group stays failed", DeviceCommError, world.group.check, "NCCL communicator error")


if __name__ == "__main__":
    run_rank(scenario)
