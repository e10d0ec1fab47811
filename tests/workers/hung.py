"""Scenarios where a rank stops without dying, or the world is aborted by a rank (argv[1]).

sigstop   rank 1 stops itself (SIGSTOP) after a first collective; the others keep issuing collectives and must
          fail with PeerLost naming rank 1 (missed heartbeats); rank 0 then resumes it (SIGCONT) so it can exit.
stall     rank 1 stays alive but stops issuing collectives; the others fail with PeerLost naming it (progress).
abort     rank 2 calls world.abort(reason); every other rank's next op fails with WorldAborted carrying it.
abort_exit rank 2 calls world.abort(reason) and exits at once, while the others wait on it inside an all_reduce:
          they may see it gone before the abort's notice arrives, and must still fail with WorldAborted and the
          reason (the coordinator has it), not a bare PeerLost.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank

import paramplane as pp


def _until_error(world: Any, rep: Report) -> pp.PlaneError | None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            world.group.all_reduce(np.ones(4))
        except pp.PlaneError as exc:
            rep.values.update(
                error=type(exc).__name__, message=str(exc), rank=getattr(exc, "rank", -1), at=time.time()
            )
            return exc
        time.sleep(0.05)  # pacing: one small collective every 50 ms
    rep.check("an error arrived", False, "none within 60 s")
    return None


def sigstop(world: Any, rep: Report) -> None:
    out = Path(os.environ["PARAMPLANE_TEST_OUT"])
    world.group.all_reduce(np.ones(4))
    if world.rank == 1:
        (out / "stopped.pid").write_text(str(os.getpid()))
        rep.values["stopped_at"] = time.time()
        rep.write()  # in case it never runs again
        os.kill(os.getpid(), signal.SIGSTOP)
        _until_error(world, rep)  # resumed: the world is gone for it too
        return
    _until_error(world, rep)
    if world.rank == 0:
        os.kill(int((out / "stopped.pid").read_text()), signal.SIGCONT)


def stall(world: Any, rep: Report) -> None:
    """Rank 1 stays alive and heartbeating but stops issuing collectives (stuck in its own code) until
    the world aborts; the others wait on it in an all_reduce."""
    world.group.all_reduce(np.ones(4))
    if world.rank == 1:
        rep.values["stalled_at"] = time.time()
        rep.check("the coordinator noticed", world.runtime.aborted.wait(60), "no abort within 60 s")
        return
    _until_error(world, rep)


def abort(world: Any, rep: Report) -> None:
    world.group.all_reduce(np.ones(4))
    if world.rank == 2:
        world.abort("loss became NaN at step 7")
    _until_error(world, rep)


def abort_exit(world: Any, rep: Report) -> None:
    world.group.all_reduce(np.ones(4))
    if world.rank == 2:
        rep.values.update(error="WorldAborted", message="loss became NaN at step 7 (this rank aborted)")
        rep.write()
        world.abort("loss became NaN at step 7")
        os._exit(0)  # no shutdown, no leave: gone the moment the abort call returns
    _until_error(world, rep)


if __name__ == "__main__":
    run_rank({"sigstop": sigstop, "stall": stall, "abort": abort, "abort_exit": abort_exit}[sys.argv[1]])
